"""Self-distillation data: the target's own responses to training prompts, as token ids.

Format (one JSON object per line, UTF-8; every trainer reads it through `read_distill`):

    {"id": str, "source": str, "prompt_ids": [int, ...], "response_ids": [int, ...], "finished": bool,
     "prompt_id": str, "target": {dtype: str}, "generation": {"temperature": float, "seed": int | null,
     "max_new_tokens": int, "dtype": str, "raw": true (only with `distill --raw`)}}

`prompt_ids` is the chat-templated prompt exactly as specframe feeds it (with `--raw`, the prompt text encoded
as it is, as `generate --raw` feeds it); `response_ids` the target's greedy
(or sampled) continuation, EOS included when it was reached (`finished`). `id` names the response and
`prompt_id` the prompt it answers: they are equal, except that a pass run with a tag (`distill --tag s1`, e.g.
a second, sampled response to every prompt in the same file) writes `id` = "<prompt id>#s1". Trainers split
held-out data by `prompt_id`, so all responses to one prompt fall on the same side. `prompt_id` may be
absent (files written before it existed): it is then `id`. `target` names the model that wrote the row
(`specframe.fingerprint.data_fingerprint`; absent in files written before 2026-12-05): a file holds one
target's responses, and a trainer says when its target is not the one that wrote the data. `generation` holds
the settings the response was made with (the seed only when sampled; absent before 2026-12-05): a pass (the rows
of one tag) is continued only with its own settings. The file is appended one batch at a time, so an interrupted
run resumes where it stopped: ids already present are skipped.
Spec-Bench is for measurement only; prompts that look like Spec-Bench questions are refused.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from specframe.errors import BadInputError, check_output_path, is_count, user_path
from specframe.sampling import check_seed

SHARED_DATA = Path("..") / "shared" / "data"  # from the project root
DEFAULT_PROMPTS = "train_prompts/prompts.jsonl"  # under SHARED_DATA


def shared_data_file(relative: str) -> Path:
    """`../shared/data/<relative>` from the working directory, else from this source checkout (so the defaults
    work from any folder); when neither exists, the working directory's (the error then names it)."""
    here = Path.cwd() / SHARED_DATA / relative
    if here.is_file():
        return here
    checkout = Path(__file__).resolve().parents[1] / SHARED_DATA / relative  # specframe/ -> project root
    return checkout if checkout.is_file() else here


@dataclass
class DistillExample:
    id: str
    source: str
    prompt_ids: list[int]
    response_ids: list[int]
    finished: bool
    prompt_id: str = ""  # the prompt this responds to ("" in the constructor: the same as `id`)
    target: dict[str, str] | None = None  # the `data_fingerprint` of the model that wrote it (None: not recorded)
    generation: dict | None = None  # the settings it was made with (None: not recorded)

    def __post_init__(self) -> None:
        self.prompt_id = self.prompt_id or self.id


def existing_file(path: str | Path, what: str, hint: str = "") -> Path:
    """`path` (with ~ expanded) when it is a regular file, else a BadInputError naming `what` and the path."""
    p = Path(user_path(str(path)))
    if p.is_dir():
        raise BadInputError(f"{what} '{path}' is a folder, not a file{hint}")
    if not p.exists():
        raise BadInputError(f"{what} '{path}' does not exist{hint}")
    if not p.is_file():
        raise BadInputError(f"{what} '{path}' is not a regular file{hint}")
    return p


def read_jsonl(
    path: str | Path, what: str, hint: str = "", unfinished_tail: bool = False
) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line; a missing file or bad JSON is a BadInputError naming
    `what` (e.g. "prompts file"), the file and the line. With `unfinished_tail`, a last line that has no line
    end and is not JSON (an interrupted write) is skipped."""
    p = existing_file(path, what, hint)
    with p.open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                if unfinished_tail and not raw.endswith(b"\n"):  # (a write cut inside a character)
                    return
                where = f"{what} '{path}' line {number}"
                raise BadInputError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except (json.JSONDecodeError, RecursionError) as e:  # (RecursionError: nested too deeply to parse)
                if unfinished_tail and not line.endswith("\n"):
                    return
                raise BadInputError(f"{what} '{path}' line {number}: not JSON ({e})") from e
            if not isinstance(row, dict):
                raise BadInputError(f"{what} '{path}' line {number}: not a JSON object")
            yield number, row


def record_id(line_of: dict[str, int], rid: str, where: str, number: int, hint: str = "") -> None:
    """Note that id `rid` is on line `number`; an id already seen is a BadInputError naming both lines
    (`where` is e.g. "prompts file 'p.jsonl'"). Ids name responses, so each appears once per file."""
    if rid in line_of:
        raise BadInputError(f"{where} line {number}: id '{rid}' is already on line {line_of[rid]}{hint}")
    line_of[rid] = number


def read_prompts(
    path: str | Path,
    benchmark_turns: Iterable[str] = (),
    empty: list[str] | None = None,
    limit: int | None = None,
) -> list[dict]:
    """Training prompts, the first `limit` of them (the whole file is checked all the same); refuses Spec-Bench's
    file and any prompt equal (up to whitespace) to one of `benchmark_turns` (the benchmark's questions, when their
    file is at hand). Empty prompts (all whitespace) are left out, and those among the prompts read have their
    "id (line N)" appended to `empty` for the caller to report: a response to nothing teaches nothing, and real
    prompt sets have them (the shared prompts file has one, a ShareGPT first turn)."""
    if limit is not None and (type(limit) is not int or limit < 1):  # (rows[:-1] would drop the last one unsaid)
        raise BadInputError(f"limit must be an integer >= 1 (or None: every prompt), got {limit!r}")
    benchmark = {" ".join(t.split()) for t in benchmark_turns}
    rows = []
    line_of: dict[str, int] = {}
    for number, row in read_jsonl(path, "prompts file"):
        if "question_id" in row or "turns" in row:
            raise BadInputError(f"{path} looks like Spec-Bench (question_id/turns): never train on it")
        if not isinstance(row.get("prompt"), str) or "id" not in row:
            raise BadInputError(f"prompts file '{path}' line {number}: each line needs 'id' and a string 'prompt'")
        pid = str(row["id"])
        record_id(line_of, pid, f"prompts file '{path}'", number)  # (else responses would share an id)
        if "#" in pid:
            raise BadInputError(
                f"prompts file '{path}' line {number}: id '{pid}' has '#', which marks a further response "
                "('<prompt id>#<tag>', `distill --tag`)"
            )
        if not row["prompt"].strip():  # (after the id checks: a repeated id is refused even on an empty prompt)
            if empty is not None and (limit is None or len(rows) < limit):
                empty.append(f"{pid} (line {number})")
            continue
        if " ".join(row["prompt"].split()) in benchmark:
            raise BadInputError(
                f"prompts file '{path}' line {number}: prompt '{pid}' is a Spec-Bench question: never train on it"
            )
        rows.append(row)
    if not rows:
        raise BadInputError(
            f"prompts file '{path}' holds no prompts (one JSON object per line: id, prompt; empty ones do not count)"
        )
    return rows[:limit]


DISTILL_HINT = " (make it with `specframe data distill`)"  # (after a distillation data file's errors)


def read_distill(path: str | Path, unfinished_tail: bool = False) -> list[DistillExample]:
    """The rows of a distillation data file (`unfinished_tail`: as `read_jsonl`'s)."""
    out = []
    line_of: dict[str, int] = {}
    repeated = " (a further response to a prompt needs its own id: `distill --tag`)"
    for number, row in read_jsonl(path, "distillation data", DISTILL_HINT, unfinished_tail):
        try:
            example = DistillExample(
                str(row["id"]),
                row.get("source", ""),
                row["prompt_ids"],
                row["response_ids"],
                bool(row.get("finished", False)),
                str(row.get("prompt_id", "")),
                row.get("target"),
                row.get("generation"),
            )
        except KeyError as e:
            raise BadInputError(f"distillation data '{path}' line {number}: missing {e}") from e
        if not isinstance(row.get("finished", False), bool):  # ("false" is a true string)
            raise BadInputError(f"distillation data '{path}' line {number}: finished must be true or false")
        if example.generation is not None and not isinstance(example.generation, dict):
            raise BadInputError(f"distillation data '{path}' line {number}: generation must be an object")
        written_by = example.target
        if written_by is not None and not (
            isinstance(written_by, dict) and written_by and all(isinstance(v, str) for v in written_by.values())
        ):
            raise BadInputError(
                f"distillation data '{path}' line {number}: target must map dtypes to hashes (as distill writes it)"
            )
        for field, ids, least in (("prompt_ids", example.prompt_ids, 1), ("response_ids", example.response_ids, 0)):
            if not (isinstance(ids, list) and len(ids) >= least and all(is_count(t, 0) for t in ids)):
                what = "a non-empty list" if least else "a list"
                raise BadInputError(
                    f"distillation data '{path}' line {number}: {field} must be {what} of token ids (integers >= 0)"
                )
        record_id(line_of, example.id, f"distillation data '{path}'", number, repeated)
        out.append(example)
    return out


def end_unfinished_line(path: Path, quiet: bool = False) -> None:
    """Before a resume appends to `path`: a last line without its line end gets one when it is a whole JSON
    object (an editor dropped it), and is removed when it is not (a write that was interrupted), with a message;
    appending to it would break the row and the next one."""
    with path.open("rb+") as f:
        if f.seek(0, 2) == 0:
            return
        f.seek(-1, 2)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        start = f.read().rfind(b"\n") + 1  # where the last line starts (only in this rare case is it all read)
        f.seek(start)
        tail = f.read()
        try:
            whole = isinstance(json.loads(tail), dict)
        except (ValueError, RecursionError):  # (RecursionError: nested too deeply to parse)
            whole = False
        if whole:
            f.write(b"\n")
            return
        f.truncate(start)
    if not quiet:
        print(
            f"removed the unfinished last line of '{path}' ({len(tail)} bytes, an interrupted write)", file=sys.stderr
        )


def check_tag(tag: str) -> None:
    if tag and not re.fullmatch(r"[A-Za-z0-9_-]+", tag):
        raise BadInputError(f"distill tag must be letters, digits, '-' or '_', got {tag!r}")


def response_id(prompt_id: str, tag: str) -> str:
    return f"{prompt_id}#{tag}" if tag else prompt_id


def tag_of(example: DistillExample) -> str:
    """The tag of the pass that wrote `example` ("" for an untagged one)."""
    return example.id.removeprefix(example.prompt_id + "#") if example.id != example.prompt_id else ""


def batches(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


@torch.inference_mode()
def distill(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[dict],
    out_path: str | Path,
    max_new_tokens: int = 128,
    batch_size: int = 32,
    max_prompt_tokens: int = 384,
    temperature: float = 0.0,
    seed: int = 0,
    quiet: bool = False,
    tag: str = "",
    raw: bool = False,
) -> int:
    """Append the target's responses for every prompt not yet in `out_path`; return how many were added.

    With a `tag`, responses get the id "<prompt id>#<tag>", so one file can hold several responses per prompt
    (e.g. a greedy pass and a sampled one): a pass is resumed by its own ids. `raw`: the prompt text as it is,
    without the chat template (as `specframe generate --raw` gives it; for base models, which have none)."""
    check_tag(tag)
    check_seed(seed, "seed", unset="")
    from specframe.kv_cache import new_cache  # (here: reading data files needs no transformers)

    new_cache(model)  # (a target that speculative decoding refuses, e.g. with a recurrent cache: refused here too)
    if not raw and not getattr(tokenizer, "chat_template", None):
        raise BadInputError(
            "the target's tokenizer has no chat template: distill applies it to every prompt, as specframe generate "
            "does to text prompts; --raw (raw=True) takes each prompt's text as it is, as generate --raw does"
        )
    out = Path(user_path(str(out_path)))
    check_output_path(out, "--out", folder=False)
    with only_writer(out):
        return _append_responses(
            model, tokenizer, prompts, out, max_new_tokens, batch_size, max_prompt_tokens, temperature, seed, quiet,
            tag, raw,
        )  # fmt: skip


_WRITING: dict[str, int] = {}  # the --out files this process holds the lock of: the thread's (re-entrant in it)


@contextlib.contextmanager
def only_writer(out: str | Path, option: str = "--out", run: str = "distill run") -> Iterator[None]:
    """This process as the only `run` writing to `out` (a file or a folder, given as `option`) for the duration:
    another one is refused (two distill runs would each answer the same prompts, and the repeated ids make the
    file unreadable; one could also cut the line the other is writing, taking it for a crash's; two training
    runs would leave one's weights with the other's config). An exclusive lock on `.<name>.lock` beside `out`,
    removed at the end (the lock is released when the process ends, however it ends; a file a killed run left is
    locked again); unlocked where the system has no `fcntl`, or no lock can be had there (a read-only folder, a
    file system without locks, the root folder): the run goes on rather than being refused. Folders made for
    `out` are removed again when nothing was written."""
    out = Path(user_path(str(out))).resolve()
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        fcntl = None
    writer = _WRITING.get(str(out))
    if writer is not None and writer != threading.get_ident():
        raise BadInputError(
            f"{option} '{out}' is being written by another {run} in this process (another thread): give another "
            f"{option}"
        )
    if fcntl is None or writer is not None or not out.name:  # (the root folder has no name, nor anything beside it)
        yield
        return
    lock = out.with_name(f".{out.name}.lock")
    made = [folder for folder in (out.parent, *out.parent.parents) if not folder.exists()]  # (deepest first)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd = _locked(lock, fcntl)
    except BlockingIOError:
        _remove_folders(made)
        resumed = "with the same command" if run == "distill run" else "with --resume"
        raise BadInputError(
            f"{option} '{out}' is being written by another {run}: wait for it to end (it can then be resumed "
            f"{resumed}), or give another {option}"
        ) from None
    except OSError:
        yield
        return
    _WRITING[str(out)] = threading.get_ident()
    try:
        yield
    finally:
        del _WRITING[str(out)]
        with contextlib.suppress(OSError):  # (while held: a run that opened it meanwhile sees it gone, in _locked)
            lock.unlink()
        os.close(fd)
        if not out.exists():  # (nothing written: no folders made either)
            _remove_folders(made)


def _locked(lock: Path, fcntl) -> int:
    """A descriptor of `lock` holding its exclusive lock (unlocked where the file system has no locks), or
    BlockingIOError while another process holds it. The file locked is the one at `lock` once locked: a run that
    ends removes its lock file, and one that opened that file before it went retries on the file now there."""
    for _ in range(100):
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except PermissionError:  # (another user's file: read-only opens lock too, except on NFS)
            fd = os.open(lock, os.O_RDONLY)
        except FileNotFoundError:  # (a run ending with nothing written removed the folder it had made: again)
            lock.parent.mkdir(parents=True, exist_ok=True)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise
        except OSError:  # (a file system without locks)
            return fd
        try:
            now = os.stat(lock)
        except FileNotFoundError:
            now = None
        held = os.fstat(fd)
        if now is not None and (now.st_dev, now.st_ino) == (held.st_dev, held.st_ino):
            return fd
        os.close(fd)
    raise OSError(f"no steady lock file at {lock}")  # (runs went on removing it: then unlocked)


def _remove_folders(folders: list[Path]) -> None:
    """Empty folders removed, deepest first (one that is not empty, or not there, ends it)."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


def _append_responses(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[dict],
    out: Path,
    max_new_tokens: int,
    batch_size: int,
    max_prompt_tokens: int,
    temperature: float,
    seed: int,
    quiet: bool,
    tag: str,
    raw: bool,
) -> int:
    """`distill`'s work, under its lock on `out`."""
    from tqdm import tqdm

    from specframe.architectures import eos_token_ids
    from specframe.decoder import chat_ids
    from specframe.fingerprint import data_fingerprint, same_data_target
    from specframe.kv_cache import context_limit
    from specframe.models import neutral_generation_config

    # (read before the unfinished last line is mended, so a file that is not distillation data is refused
    # untouched; the rows are the same after it: a whole last row is read, a cut one skipped and then removed)
    existing = read_distill(out, unfinished_tail=True) if out.exists() else []
    if out.exists():
        end_unfinished_line(out, quiet)
    written_by = data_fingerprint(model)
    other = next((e for e in existing if e.target is not None and not same_data_target(e.target, written_by)), None)
    if other is not None:  # (its ids would be skipped as answered: one file would hold two targets' responses)
        raise BadInputError(
            f"--out '{out}' holds responses written by another target (e.g. '{other.id}'): distil this target's "
            "into another file"
        )
    settings = {
        "temperature": float(temperature),
        "seed": seed if temperature > 0 else None,
        "max_new_tokens": max_new_tokens,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        **({"raw": True} if raw else {}),  # (absent when false: rows written before it was recorded compare equal)
    }
    pass_rows = (e for e in existing if e.generation is not None and tag_of(e) == tag)
    earlier = next((e for e in pass_rows if e.generation != settings), None)
    if earlier is not None:  # (the pass would mix responses made two ways under one tag)
        before, now = ({"raw": False, **s} for s in (earlier.generation, settings))  # (raw: absent = false)
        what = ", ".join(
            f"{k} {before.get(k)} (now {now.get(k)})" for k in {**before, **now} if before.get(k) != now.get(k)
        )
        raise BadInputError(
            f"--out '{out}' holds the {'pass tagged ' + repr(tag) if tag else 'untagged pass'} made with {what} "
            f"(e.g. '{earlier.id}'): continue it with the same settings, or start another with --tag"
        )
    done = {e.id for e in existing}
    # Prompts must leave room for a response in the target's context window, as `specframe generate` requires, and
    # responses end there as generate's do: the sliding attention window of a target served only inside it, where
    # that is smaller (past it the decoder stops, so data from past it would never be used:
    # `specframe.kv_cache.context_window`).
    window, kind = context_limit(model)
    longest = min(max_prompt_tokens, window - 1)
    todo, too_long = [], 0
    for row in prompts:
        if response_id(str(row["id"]), tag) in done:
            continue
        text = row["prompt"]
        ids = tokenizer(text)["input_ids"] if raw else chat_ids(tokenizer, [{"role": "user", "content": text}])
        if len(ids) <= longest:
            todo.append((str(row["id"]), row.get("source", ""), ids))
        else:
            too_long += 1
    if too_long and not quiet:
        limit = f"{max_prompt_tokens} tokens (--max-prompt-tokens)"
        if longest < max_prompt_tokens:
            limit = f"{longest} tokens (the target's {kind} is {window})"
        print(f"skipping {too_long} prompts longer than {limit}", file=sys.stderr)
    answered = len(prompts) - len(todo) - too_long
    if not todo and answered and not quiet:
        print(
            f"every prompt that fits ({answered}) already has a response{f' tagged {tag!r}' if tag else ''} in "
            f"'{out}'; a further response to each needs another --tag",
            file=sys.stderr,
        )
    if not todo:
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    todo.sort(key=lambda t: len(t[2]))  # similar lengths per batch: little padding
    # Every EOS the decoder stops at (the target's generation_config and its tokenizer), not the tokenizer's only.
    eos = eos_token_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    device = next(model.parameters()).device
    added = 0
    bar = tqdm(total=len(todo), desc="distill", unit="prompt", disable=quiet, file=sys.stderr)
    start = time.perf_counter()
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    # (the seed draws the sampled responses; the caller's random generators are put back afterwards)
    with torch.random.fork_rng(devices=gpus), out.open("a", encoding="utf-8") as f:
        torch.manual_seed(seed)
        for batch in batches(todo, batch_size):
            width = max(len(ids) for _, _, ids in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros_like(input_ids)
            for i, (_, _, ids) in enumerate(batch):  # left padding
                input_ids[i, width - len(ids) :] = torch.tensor(ids)
                mask[i, width - len(ids) :] = 1
            with neutral_generation_config(model):  # (the target's own responses, as the decoder gives them)
                gen = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=min(max_new_tokens, window - width),
                    do_sample=temperature > 0,
                    temperature=temperature if temperature > 0 else None,
                    top_p=None,
                    top_k=None,
                    eos_token_id=sorted(eos) or None,
                    pad_token_id=pad,
                )[:, width:].tolist()
            for (prompt_id, source, ids), resp in zip(batch, gen, strict=True):
                end = next((i for i, t in enumerate(resp) if t in eos), None)
                finished = end is not None
                resp = resp[: end + 1] if finished else resp
                row = {
                    "id": response_id(prompt_id, tag),
                    "source": source,
                    "prompt_ids": ids,
                    "response_ids": resp,
                    "finished": finished,
                    "prompt_id": prompt_id,
                    "target": written_by,
                    "generation": settings,
                }
                f.write(json.dumps(row) + "\n")
            f.flush()
            added += len(batch)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{sum(len(r) for r in gen) / max(1e-9, time.perf_counter() - start):.0f}")
            start = time.perf_counter()
    bar.close()
    return added
