import json
import warnings

import pytest
import torch
from transformers import AutoTokenizer

from specframe.data import distill, read_distill
from specframe.errors import BadInputError
from specframe.testing.conformance import reference_greedy
from specframe.testing.tiny import tiny_llama
from specframe.training.common import split_heldout

PROMPTS = [
    {"id": f"q{i}", "source": "test", "prompt": " ".join("abcdef"[(i + j) % 6] for j in range(2 + i % 4))}
    for i in range(12)
]


@pytest.fixture
def tokenizer(tiny_dirs):
    tok = AutoTokenizer.from_pretrained(tiny_dirs["target"])
    tok.chat_template = (
        "{% for m in messages %}{{ m['content'] }} {% endfor %}{% if add_generation_prompt %}a{% endif %}"
    )
    return tok


def run(model, tokenizer, out, **options):
    return distill(model, tokenizer, PROMPTS, out, max_new_tokens=4, batch_size=5, quiet=True, **options)


def test_greedy_pass_is_the_target_greedy_response_and_resumes(tokenizer, tmp_path):
    model = tiny_llama(vocab_size=8, seed=0)
    out = tmp_path / "d.jsonl"
    assert run(model, tokenizer, out) == len(PROMPTS)
    rows = read_distill(out)
    assert sorted(r.id for r in rows) == sorted(p["id"] for p in PROMPTS)
    for r in rows:
        assert r.prompt_id == r.id
        # batched, left-padded generation gives what one unpadded sequence gives
        greedy = reference_greedy(model, r.prompt_ids, 4)
        assert r.response_ids == (greedy[: greedy.index(1) + 1] if 1 in greedy else greedy)
        assert r.finished == (1 in greedy)
    assert run(model, tokenizer, out) == 0  # resumed: every prompt is done


def test_a_second_run_on_the_same_out_is_refused_while_the_first_writes(tokenizer, tmp_path, capsys):
    # (two runs on one --out each answered every prompt: 80 rows for 40 prompts, and the repeated ids made the
    # file unreadable for good; the second could also cut the line the first was writing, as a crash's)
    import fcntl
    import os

    from specframe.cli import main
    from specframe.data import only_writer

    model = tiny_llama(vocab_size=8, seed=0)
    out = tmp_path / "d.jsonl"
    run(model, tokenizer, out)
    half = out.read_bytes() + b'{"id": "being written'
    out.write_bytes(half)
    held = os.open(tmp_path / ".d.jsonl.lock", os.O_RDWR | os.O_CREAT)  # (the lock file beside it, held by a run)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        with pytest.raises(BadInputError, match=r"--out '.*d.jsonl' is being written by another distill run"):
            run(model, tokenizer, out, tag="s1", temperature=0.7, seed=1)
        assert out.read_bytes() == half
        # the command refuses it before loading the model (here, one that does not exist)
        (tmp_path / "p.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n")
        capsys.readouterr()
        argv = ["data", "distill", "--out", str(tmp_path / "." / "d.jsonl"), "--target", str(tmp_path / "absent")]
        assert main([*argv, "--prompts", str(tmp_path / "p.jsonl")]) == 2
        err = capsys.readouterr().err
        assert "is being written by another distill run" in err and "absent" not in err, err
    finally:
        os.close(held)
    out.write_bytes(half[: half.rindex(b"\n") + 1])
    with only_writer(out):  # (a run's own lock: the run inside it goes on)
        assert run(model, tokenizer, out, tag="s1", temperature=0.7, seed=1) == len(PROMPTS)


def test_a_distill_run_leaves_no_lock_file_and_no_folders_when_it_wrote_nothing(tokenizer, tmp_path, capsys):
    from specframe.cli import main

    model = tiny_llama(vocab_size=8, seed=0)
    out = tmp_path / "runs" / "d.jsonl"
    run(model, tokenizer, out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["d.jsonl"]  # (no .d.jsonl.lock left beside it)
    (tmp_path / "p.jsonl").write_text(json.dumps(PROMPTS[0]) + "\n")
    argv = ["data", "distill", "--out", str(tmp_path / "n1" / "n2" / "n3" / "d.jsonl"), "--raw"]
    assert main([*argv, "--target", str(tmp_path / "absent"), "--prompts", str(tmp_path / "p.jsonl")]) == 2
    assert "absent" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.jsonl", "runs"]  # (n1 and n1/n2 went too)


def test_a_lock_file_replaced_while_a_run_opened_it_is_locked_again(tmp_path):
    # A run opens the lock file just as the run holding it ends (and removes it) and a third run makes a new one
    # and locks it: the lock then had on the removed file is no lock, and the run tries the file now there.
    import fcntl
    import os
    import types

    from specframe.data import _locked

    lock = tmp_path / ".d.jsonl.lock"
    lock.touch()
    third = []

    def flock(fd, how):
        if not third:  # (between this run's open and its lock: the first ends, a third starts)
            lock.unlink()
            third.append(os.open(lock, os.O_RDWR | os.O_CREAT))
            fcntl.flock(third[0], fcntl.LOCK_EX)
        fcntl.flock(fd, how)

    try:
        with pytest.raises(BlockingIOError):
            _locked(lock, types.SimpleNamespace(flock=flock, LOCK_EX=fcntl.LOCK_EX, LOCK_NB=fcntl.LOCK_NB))
    finally:
        os.close(third[0])
    fd = _locked(lock, fcntl)  # (once the third is done, its file is had)
    assert os.fstat(fd).st_ino == os.stat(lock).st_ino
    os.close(fd)


def test_a_lock_whose_folder_another_run_removed_is_still_taken(tmp_path):
    # (a run ending with nothing written removes the folder it made, between another run's mkdir and its open of
    # the lock file there: that run went on unlocked)
    import fcntl
    import os

    from specframe.data import _locked

    lock = tmp_path / "gone" / ".d.jsonl.lock"
    fd = _locked(lock, fcntl)
    try:
        other = os.open(lock, os.O_RDWR)
        with pytest.raises(BlockingIOError):  # (held)
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(other)
    finally:
        os.close(fd)


def test_another_thread_distilling_to_the_same_out_is_refused(tmp_path):
    import threading

    from specframe.data import only_writer

    out = tmp_path / "d.jsonl"
    refused = []

    def other():
        try:
            with only_writer(out):
                refused.append(False)
        except BadInputError as e:
            refused.append(str(e))

    with only_writer(out), only_writer(out):  # (re-entrant in its own thread)
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
    assert "being written by another distill run in this process (another thread)" in refused[0]


def test_a_resume_ends_or_removes_an_unfinished_last_line(tokenizer, tmp_path, capsys):
    model = tiny_llama(vocab_size=8, seed=0)
    whole = tmp_path / "whole.jsonl"
    run(model, tokenizer, whole)
    want = {r.id: r for r in read_distill(whole)}
    for cut, message in ((1, ""), (20, "removed the unfinished last line")):
        out = tmp_path / f"cut{cut}.jsonl"
        distill(model, tokenizer, PROMPTS[:6], out, max_new_tokens=4, batch_size=5, quiet=True)
        capsys.readouterr()
        out.write_bytes(out.read_bytes()[:-cut])  # the line end lost (an editor), or a write cut mid-row (a crash)
        added = distill(model, tokenizer, PROMPTS, out, max_new_tokens=4, batch_size=5)
        assert message in capsys.readouterr().err
        assert added == (6 if cut == 1 else 7)  # (a cut row is generated again)
        assert {r.id: r for r in read_distill(out)} == want


def test_responses_end_at_every_eos_of_the_target_and_ignore_its_generation_settings(tokenizer, tmp_path):
    model = tiny_llama(vocab_size=8, seed=0)
    run(model, tokenizer, tmp_path / "a.jsonl")
    rows = read_distill(tmp_path / "a.jsonl")
    tokens = [t for r in rows for t in r.response_ids if t != 1]
    extra = max(set(tokens), key=tokens.count)  # a token the responses use: now an EOS too
    model.generation_config.eos_token_id = [1, extra]
    model.generation_config.repetition_penalty = 3.0  # (transformers would apply it unless told otherwise)
    model.generation_config.min_new_tokens = 3
    run(model, tokenizer, tmp_path / "b.jsonl")
    for r in read_distill(tmp_path / "b.jsonl"):
        greedy = reference_greedy(model, r.prompt_ids, 4)
        end = next((i for i, t in enumerate(greedy) if t in (1, extra)), None)
        assert r.response_ids == (greedy if end is None else greedy[: end + 1]) and r.finished == (end is not None)
    assert model.generation_config.repetition_penalty == 3.0  # (the target's own config is put back)


def test_prompts_and_responses_fit_the_target_s_context_window(tokenizer, tmp_path, capsys):
    model = tiny_llama(vocab_size=8, seed=0, max_position_embeddings=6)
    out = tmp_path / "d.jsonl"
    added = distill(model, tokenizer, PROMPTS, out, max_new_tokens=4, batch_size=5)
    rows = read_distill(out)
    assert added == len(rows) > 0 and all(len(r.prompt_ids) + len(r.response_ids) <= 6 for r in rows)
    assert f"skipping {len(PROMPTS) - added} prompts longer than 5 tokens (the target's context window is 6)" in (
        capsys.readouterr().err
    )


def test_prompts_over_the_limit_are_reported_and_nothing_is_written_when_none_is_left(tokenizer, tmp_path, capsys):
    model = tiny_llama(vocab_size=8, seed=0)
    out = tmp_path / "new" / "d.jsonl"
    added = distill(model, tokenizer, PROMPTS, out, max_new_tokens=4, max_prompt_tokens=1)
    assert added == 0 and not out.parent.exists()  # (before: an empty file, and "added 0" with no reason)
    assert "skipping 12 prompts longer than 1 tokens (--max-prompt-tokens)" in capsys.readouterr().err


def test_cli_refuses_an_out_that_is_a_folder_before_loading_the_target(capsys, tmp_path):
    (tmp_path / "d.jsonl").mkdir()  # (before: "distillation data '...' does not exist")
    code = distill_with_absent_target(tmp_path)
    err = capsys.readouterr().err
    assert code == 2 and "--out '" in err and "d.jsonl' is a folder; it must name a file" in err and "absent" not in err


def test_a_tagged_pass_adds_second_responses_kept_with_their_prompt_in_the_split(tokenizer, tmp_path):
    model = tiny_llama(vocab_size=8, seed=0)
    out = tmp_path / "d.jsonl"
    run(model, tokenizer, out)
    assert run(model, tokenizer, out, temperature=1.0, seed=3, tag="s1") == len(PROMPTS)
    assert run(model, tokenizer, out, temperature=1.0, seed=3, tag="s1") == 0
    rows = read_distill(out)
    assert len(rows) == 2 * len(PROMPTS)
    tagged = [r for r in rows if r.id.endswith("#s1")]
    assert sorted(r.prompt_id + "#s1" for r in tagged) == sorted(r.id for r in tagged)
    assert {r.prompt_id for r in tagged} == {p["id"] for p in PROMPTS}
    train, held = split_heldout(rows, 0.3)
    assert held and train
    assert not {r.prompt_id for r in train} & {r.prompt_id for r in held}
    # the untagged responses split exactly as they do without the tagged ones
    plain = [r for r in rows if r.id == r.prompt_id]
    assert [r.id for r in split_heldout(plain, 0.3)[1]] == [r.id for r in held if r.id == r.prompt_id]


def test_rows_record_the_target_and_a_file_holds_one_target_s_responses(tokenizer, tmp_path):
    """Each row names the model that wrote it; the same weights in bfloat16 add to the file (a tagged pass), another
    model of the same shapes and tokenizer is refused before it writes, and rows from before the field load."""
    import torch

    from specframe.fingerprint import data_fingerprint, same_data_target

    model = tiny_llama(vocab_size=8, seed=0)
    out = tmp_path / "d.jsonl"
    run(model, tokenizer, out)
    own = data_fingerprint(model)
    assert all(r.target == own for r in read_distill(out))
    assert run(model.to(torch.bfloat16), tokenizer, out, tag="b") == len(PROMPTS)
    assert all(same_data_target(r.target, own) for r in read_distill(out))
    before = out.read_bytes()
    with pytest.raises(BadInputError, match=r"holds responses written by another target \(e.g. 'q"):
        run(tiny_llama(vocab_size=8, seed=1), tokenizer, out, tag="other")
    assert out.read_bytes() == before
    old = tmp_path / "old.jsonl"  # (written before rows named their target)
    old.write_text(json.dumps({"id": "q0", "prompt_ids": [1], "response_ids": [2], "finished": False}) + "\n")
    assert read_distill(old)[0].target is None
    assert run(tiny_llama(vocab_size=8, seed=1), tokenizer, old) == len(PROMPTS) - 1
    old.write_text(json.dumps({"id": "q0", "prompt_ids": [1], "response_ids": [2], "target": "x"}) + "\n")
    with pytest.raises(BadInputError, match="line 1: target must map dtypes to hashes"):
        read_distill(old)


def test_rows_without_prompt_id_answer_the_prompt_named_by_their_id(tmp_path):
    row = {"id": "x", "source": "s", "prompt_ids": [1], "response_ids": [2], "finished": True}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    assert read_distill(tmp_path / "d.jsonl")[0].prompt_id == "x"


def test_an_id_twice_is_refused_naming_both_lines(tmp_path):
    row = {"id": "x", "source": "s", "prompt_ids": [1], "response_ids": [2], "finished": True}
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (row, row | {"id": "y"}, row)))
    with pytest.raises(BadInputError, match="line 3: id 'x' is already on line 1"):
        read_distill(tmp_path / "d.jsonl")


@pytest.mark.parametrize(
    "field, value",
    [
        ("prompt_ids", []),
        ("prompt_ids", [1, -2]),
        ("response_ids", [1.5]),
        ("response_ids", [True]),
        ("response_ids", "12"),
        ("prompt_ids", [[1]]),
        ("response_ids", None),
    ],
)
def test_token_ids_that_are_not_lists_of_ids_are_refused_naming_the_line(tmp_path, field, value):
    row = {"id": "x", "source": "s", "prompt_ids": [1], "response_ids": [2], "finished": True}
    lines = [row | {"id": "a"}, row | {field: value}]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(BadInputError, match=f"line 2: {field} must be .*list of token ids"):
        read_distill(tmp_path / "d.jsonl")


def test_a_finished_flag_that_is_not_a_boolean_is_refused(tmp_path):
    row = {"id": "x", "source": "s", "prompt_ids": [1], "response_ids": [2], "finished": "false"}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(BadInputError, match="line 1: finished must be true or false"):
        read_distill(tmp_path / "d.jsonl")


def test_a_tokenizer_without_a_chat_template_is_refused_unless_raw(tokenizer, tmp_path):
    model = tiny_llama(vocab_size=8, seed=0)
    template, tokenizer.chat_template = tokenizer.chat_template, None
    with pytest.raises(BadInputError, match="the target's tokenizer has no chat template: .*--raw"):
        run(model, tokenizer, tmp_path / "d.jsonl")
    # raw: each prompt's text as it is (a base model's data), as generate --raw encodes it; recorded, not mixed
    assert run(model, tokenizer, tmp_path / "d.jsonl", raw=True) == len(PROMPTS)
    rows = {r.id: r for r in read_distill(tmp_path / "d.jsonl")}
    for p in PROMPTS:
        row = rows[p["id"]]
        assert row.prompt_ids == tokenizer(p["prompt"])["input_ids"] and row.generation["raw"] is True
        greedy = reference_greedy(model, row.prompt_ids, 4)
        assert row.response_ids == (greedy[: greedy.index(1) + 1] if 1 in greedy else greedy)
    tokenizer.chat_template = template
    with pytest.raises(BadInputError, match=r"made with raw True \(now False\)"):
        run(model, tokenizer, tmp_path / "d.jsonl")  # (a templated pass would mix two encodings under one tag)


@pytest.mark.parametrize("tag", ["a b", "s#1", "é"])
def test_bad_tag_is_refused(tokenizer, tmp_path, tag):
    with pytest.raises(BadInputError, match="tag"):
        run(tiny_llama(vocab_size=8, seed=0), tokenizer, tmp_path / "d.jsonl", tag=tag)


def test_cli_refuses_an_out_where_nothing_can_be_made_and_reads_a_tilde_as_home(
    capsys, tmp_path, monkeypatch, unwritable_folder
):
    from specframe.cli import main

    where = unwritable_folder
    code = main(["data", "distill", "--out", f"{where}/d.jsonl", "--target", str(tmp_path / "absent")])
    err = capsys.readouterr().err
    assert code == 2 and f"--out '{where}/d.jsonl' cannot be written" in err and "absent" not in err, err
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "d.jsonl").mkdir()  # (the --out checked first: the folder in the home folder is named)
    code = main(["data", "distill", "--out=~/d.jsonl", "--target", "x"])
    err = capsys.readouterr().err
    assert code == 2 and f"--out '{tmp_path}/d.jsonl' is a folder" in err, err
    (tmp_path / "d.jsonl").rmdir()
    (tmp_path / "prompts.jsonl").write_text("not json\n")
    code = main(["data", "distill", "--out=~/d.jsonl", "--prompts=~/prompts.jsonl", "--target", "x"])
    err = capsys.readouterr().err  # (the prompts file read from the home folder: its content is refused)
    assert code == 2 and f"'{tmp_path}/prompts.jsonl'" in err and "line 1" in err, err


def distill_with_absent_target(tmp_path, *options: str) -> int:
    """`specframe data distill` with a target that does not exist: what fails must fail before it loads."""
    from specframe.cli import main

    return main(["data", "distill", "--out", str(tmp_path / "d.jsonl"), "--target", str(tmp_path / "absent"), *options])


def test_cli_distills_what_the_api_does_then_resumes_with_nothing_to_add(capsys, tmp_path, tokenizer, tiny_dirs):
    """`specframe data distill` as a user runs it: a target directory (with a chat template), a prompts file;
    it writes the rows the Python API writes for the same model, says how many, and a second run adds none."""
    from transformers import AutoModelForCausalLM

    from specframe.cli import main

    target = tmp_path / "target"
    AutoModelForCausalLM.from_pretrained(tiny_dirs["target"]).save_pretrained(target)
    tokenizer.save_pretrained(target)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "d.jsonl"
    argv = ["data", "distill", "--target", str(target), "--prompts", str(prompts), "--out", str(out)]
    argv += ["--dtype", "float32", "--device", "cpu", "--max-new-tokens", "4", "--batch-size", "5"]
    assert main(argv) == 0
    assert f"added {len(PROMPTS)} responses to {out}" in capsys.readouterr().err
    model = AutoModelForCausalLM.from_pretrained(target)
    run(model, tokenizer, tmp_path / "api.jsonl")
    assert read_distill(out) == read_distill(tmp_path / "api.jsonl")
    assert main(argv) == 0 and f"added 0 responses to {out}" in capsys.readouterr().err


def test_cli_refuses_a_bad_tag_before_loading_the_target(capsys, tmp_path):
    code = distill_with_absent_target(tmp_path, "--prompts", str(tmp_path / "absent.jsonl"), "--tag", "a b")
    err = capsys.readouterr().err
    assert code == 2 and "distill tag" in err and "absent" not in err
    code = distill_with_absent_target(tmp_path, "--prompts", str(tmp_path / "absent.jsonl"), "--seed", str(10**23))
    err = capsys.readouterr().err  # (at --temperature 0 too: it was torch's "Overflow", exit 1, after the load)
    assert code == 2 and "--seed must be an integer in [-2**63, 2**64), got 1000" in err and "absent" not in err


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}], "line 2: id 'a' is already on line 1"),
        ([{"id": "a#s1", "prompt": "x"}], "line 1: id 'a#s1' has '#'"),
        ([{"id": "a", "prompt": "x"}, {"id": "b", "prompt": " What is  2+2? "}], "line 2: prompt 'b' is a Spec-Bench"),
        ([], "holds no prompts"),  # (an empty file was a successful run that added nothing)
        ([{"id": "b", "prompt": " \n"}], "holds no prompts .*empty ones do not count"),
        ([{"id": "a", "prompt": ""}, {"id": "a", "prompt": "y"}], "line 2: id 'a' is already on line 1"),
        # (a row with either of Spec-Bench's own keys: the file is the benchmark, whatever else it holds)
        ([{"id": "a", "prompt": "x", "turns": ["x"]}], r"looks like Spec-Bench \(question_id/turns\)"),
        ([{"id": "a", "prompt": "x", "question_id": 81}], r"looks like Spec-Bench \(question_id/turns\)"),
    ],
)
def test_prompts_that_would_break_the_data_or_leak_the_benchmark_are_refused(tmp_path, rows, message):
    from specframe.data import read_prompts

    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(BadInputError, match=message):
        read_prompts(tmp_path / "p.jsonl", benchmark_turns=["What is 2+2?"])


def test_cli_refuses_a_benchmark_question_as_a_prompt_before_loading_the_target(capsys, tmp_path, monkeypatch):
    from specframe import bench

    question = {"question_id": 1, "category": "qa", "turns": ["Who wrote Hamlet?"]}
    (tmp_path / "question.jsonl").write_text(json.dumps(question) + "\n")
    monkeypatch.setattr(bench, "default_questions_path", lambda: tmp_path / "question.jsonl")
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "q", "prompt": "Who wrote Hamlet?"}) + "\n")
    code = distill_with_absent_target(tmp_path, "--prompts", str(tmp_path / "p.jsonl"), "--debug")
    err = capsys.readouterr().err
    assert code == 2 and "prompt 'q' is a Spec-Bench question" in err and "absent" not in err


def test_cli_refuses_a_negative_temperature_before_loading_the_target(capsys, tmp_path):
    code = distill_with_absent_target(tmp_path, "--temperature", "-1")
    err = capsys.readouterr().err
    assert code == 2 and "--temperature must be a finite number >= 0" in err and "absent" not in err


def test_shared_data_is_found_from_the_working_directory_first(tmp_path, monkeypatch):
    from specframe.data import shared_data_file

    (tmp_path / "proj").mkdir()
    (tmp_path / "shared" / "data").mkdir(parents=True)
    (tmp_path / "shared" / "data" / "x.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path / "proj")
    assert shared_data_file("x.jsonl").resolve() == (tmp_path / "shared" / "data" / "x.jsonl").resolve()
    # neither there nor next to this checkout: the working directory's path, which the error then names
    assert shared_data_file("absent.jsonl") == tmp_path / "proj" / ".." / "shared" / "data" / "absent.jsonl"


def test_a_file_that_is_not_distillation_data_is_refused_untouched(tokenizer, tmp_path):
    model = tiny_llama(vocab_size=8, seed=0)
    for text in ("my notes\nimportant last line", '{"id": "1", "prompt": "hi"}'):  # (no line end at the end)
        out = tmp_path / "notes.txt"
        out.write_text(text)
        with pytest.raises(BadInputError, match="distillation data"):
            run(model, tokenizer, out)
        assert out.read_text() == text


def test_a_pass_is_continued_only_with_its_own_settings(tokenizer, tmp_path, capsys):
    model = tiny_llama(vocab_size=8, seed=0)
    out = tmp_path / "d.jsonl"
    distill(model, tokenizer, PROMPTS[:6], out, max_new_tokens=4, temperature=1.5, seed=3, tag="s2", quiet=True)
    assert {r.generation["temperature"] for r in read_distill(out)} == {1.5}
    with pytest.raises(BadInputError, match=r"pass tagged 's2' made with temperature 1.5 \(now 0.0\), seed 3"):
        run(model, tokenizer, out, tag="s2")  # (greedy, under the sampled pass's tag)
    with pytest.raises(BadInputError, match=r"max_new_tokens 4 \(now 16\)"):
        distill(model, tokenizer, PROMPTS, out, max_new_tokens=16, temperature=1.5, seed=3, tag="s2", quiet=True)
    assert run(model, tokenizer, out, temperature=1.5, seed=3, tag="s2") == 6  # the same settings: resumed
    assert run(model, tokenizer, out) == 12  # an untagged pass of its own
    with pytest.raises(BadInputError, match=r"untagged pass made with temperature 0.0 \(now 1.5\).*another with --tag"):
        run(model, tokenizer, out, temperature=1.5, seed=4)  # (a sampled pass needs a tag of its own)
    capsys.readouterr()
    assert distill(model, tokenizer, PROMPTS, out, max_new_tokens=4, batch_size=5) == 0
    assert "every prompt that fits (12) already has a response in" in capsys.readouterr().err


def test_a_folder_given_as_a_data_file_is_named_as_one(tmp_path):
    from specframe.data import read_prompts

    with pytest.raises(BadInputError, match=f"distillation data '{tmp_path}' is a folder, not a file"):
        read_distill(tmp_path)
    with pytest.raises(BadInputError, match=f"prompts file '{tmp_path}' is a folder, not a file"):
        read_prompts(tmp_path)


def test_json_nested_too_deeply_is_named_with_its_line(tmp_path):
    from specframe.data import read_jsonl

    path = tmp_path / "d.jsonl"
    path.write_text('{"a": 1}\n' + "[" * 200_000 + "\n")
    with pytest.raises(BadInputError, match=r"data '.*d.jsonl' line 2: not JSON \(maximum recursion depth"):
        list(read_jsonl(path, "data"))  # (before: Python's RecursionError, exit 1)


def test_a_file_that_is_not_utf8_is_named_with_its_line(tmp_path):
    from specframe.data import read_jsonl

    path = tmp_path / "q.jsonl"
    path.write_bytes(b'{"a": 1}\n\xff\xfe{}\n')
    with pytest.raises(BadInputError, match=r"questions file '.*q.jsonl' line 2: not UTF-8 text"):
        list(read_jsonl(path, "questions file"))  # (before: Python's UnicodeDecodeError, exit 1, no file named)
    path.write_bytes('{"a": 1}\n{"b": "é'.encode()[:-1])  # (a write cut inside a character)
    assert list(read_jsonl(path, "data", unfinished_tail=True)) == [(1, {"a": 1})]
    with pytest.raises(BadInputError, match="is not a regular file"):
        list(read_jsonl("/dev/null", "questions file"))


def test_empty_prompts_are_skipped_and_named(capsys, tmp_path):
    # A response to an empty prompt teaches nothing; real prompt sets have them (the shared file has one), so
    # distill leaves them out and says which, instead of refusing the whole file (as it did on 2026-12-05).
    rows = [
        {"id": "a", "prompt": "x"},
        {"id": "b", "prompt": " \n"},
        {"id": "c", "prompt": "y"},
        {"id": "d", "prompt": ""},
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    from specframe.data import read_prompts

    empty = []
    assert [r["id"] for r in read_prompts(tmp_path / "p.jsonl", empty=empty)] == ["a", "c"]
    assert empty == ["b (line 2)", "d (line 4)"]
    empty = []  # (with a limit, only the empty prompts before the last prompt read are said)
    assert [r["id"] for r in read_prompts(tmp_path / "p.jsonl", empty=empty, limit=1)] == ["a"]
    assert empty == []
    assert [r["id"] for r in read_prompts(tmp_path / "p.jsonl", empty=empty, limit=2)] == ["a", "c"]
    assert empty == ["b (line 2)"]
    code = distill_with_absent_target(tmp_path, "--prompts", str(tmp_path / "p.jsonl"))
    err = capsys.readouterr().err
    assert code == 2 and f"skipping 2 empty prompts in '{tmp_path / 'p.jsonl'}': b (line 2), d (line 4)" in err


def test_the_shared_prompts_file_reads_where_it_is_at_hand():
    # The default prompts file must pass the checks `specframe data distill` runs before loading the target.
    from specframe.bench import default_benchmark_turns
    from specframe.data import DEFAULT_PROMPTS, read_prompts, shared_data_file

    path = shared_data_file(DEFAULT_PROMPTS)
    if not path.is_file():
        pytest.skip(f"{path} is not at hand (it is never committed)")
    empty = []
    rows = read_prompts(path, benchmark_turns=default_benchmark_turns(), empty=empty)
    assert len(rows) > 4000 and len(rows) + len(empty) == sum(1 for line in open(path) if line.strip())


def test_distill_and_train_for_a_target_with_an_adapter(capsys, tmp_path, tokenizer, tiny_dirs):
    """`--adapter` (as generate's target.adapter): the responses and the trained drafter are the adapted target's,
    fingerprinted as such, so `generate` with that adapter takes the drafter; Medusa-2, which trains an adapter of
    its own, is refused on an adapted target."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from specframe.cli import main
    from specframe.fingerprint import ADAPTER_KEY, data_fingerprint
    from specframe.models import load_model

    target = tmp_path / "target"
    AutoModelForCausalLM.from_pretrained(tiny_dirs["target"]).save_pretrained(target)
    tokenizer.save_pretrained(target)
    base = AutoModelForCausalLM.from_pretrained(target)
    torch.manual_seed(0)
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"], init_lora_weights=False)  # (not a no-op merge)
    with warnings.catch_warnings():  # (PEFT reads a property transformers deprecated)
        warnings.simplefilter("ignore", FutureWarning)
        get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    out = tmp_path / "d.jsonl"
    argv = ["data", "distill", "--target", str(target), "--adapter", str(tmp_path / "adapter"), "--prompts"]
    argv += [str(prompts), "--out", str(out), "--dtype", "float32", "--device", "cpu", "--max-new-tokens", "6"]
    assert main(argv) == 0, capsys.readouterr().err
    adapted = load_model(str(target), dtype="float32", device="cpu", quiet=True, adapter=str(tmp_path / "adapter"))
    plain = load_model(str(target), dtype="float32", device="cpu", quiet=True)
    rows = read_distill(out)
    assert rows and all(r.target == data_fingerprint(adapted.model) for r in rows)
    assert data_fingerprint(adapted.model) != data_fingerprint(plain.model)
    train = ["train", "--target", str(target), "--adapter", str(tmp_path / "adapter"), "--device", "cpu"]
    options = [f"data={out}", "epochs=1", "vocab_size=6", "heldout_fraction=0.2", "features_cache="]
    code = main([*train, "--proposer", "eagle", f"out={tmp_path / 'eagle'}", *options])
    err = capsys.readouterr().err
    assert code == 0 and "did not write" not in err and "another target" not in err, err
    saved = json.loads((tmp_path / "eagle" / "eagle_config.json").read_text())["target"]
    assert ADAPTER_KEY in saved and saved[ADAPTER_KEY] == adapted.model._specframe_fingerprint[ADAPTER_KEY]
    code = main([*train, "--proposer", "medusa", f"out={tmp_path / 'm2'}", "stage=2", *options])
    err = capsys.readouterr().err
    assert code == 2 and "medusa stage 2 trains its own PEFT adapter, and this target already has one merged" in err
    nowhere = ["--adapter", str(tmp_path / "nowhere"), "--target", str(target), f"data={out}"]
    assert main(["train", "--proposer", "eagle", *nowhere]) == 2
    assert "nowhere" in capsys.readouterr().err


@pytest.mark.parametrize("limit", [0, -1, 2.5, True])
def test_a_prompt_limit_that_is_no_count_is_refused(tmp_path, limit):
    # (the CLI refuses --limit 0; through Python, 0 read nothing and -1 every prompt but the last)
    from specframe.data import read_prompts

    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": i, "prompt": f"p{i}"}) + "\n" for i in range(3)))
    with pytest.raises(BadInputError, match=f"limit must be an integer >= 1 .*got {limit!r}"):
        read_prompts(tmp_path / "p.jsonl", limit=limit)
    assert [r["prompt"] for r in read_prompts(tmp_path / "p.jsonl", limit=2)] == ["p0", "p1"]


def test_a_sampled_pass_is_seeded_and_leaves_the_callers_generator_as_it_was(tokenizer, tmp_path, changes_global_rng):
    model = tiny_llama(vocab_size=8, seed=0)
    for name in ("a", "b"):
        assert not changes_global_rng(lambda name=name: run(model, tokenizer, tmp_path / name, temperature=1.0, seed=3))
    assert (tmp_path / "a").read_text() == (tmp_path / "b").read_text()  # (the seed's responses, both times)
