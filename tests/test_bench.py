"""`specframe bench` on tiny random models: outputs and their structure, aggregation maths, identity, errors."""

import contextlib
import dataclasses
import io
import itertools
import json
import re
import types

import pytest
import torch
from tqdm import tqdm  # (its bar disabled: the options say progress=False)

from specframe import bench
from specframe.cli import main
from specframe.errors import BadInputError
from specframe.lean_forward import lean_forward_applies
from specframe.testing.conformance import reference_greedy
from specframe.testing.tiny import tiny_llama

QUESTIONS = [
    {"question_id": 81, "category": "writing", "turns": ["a b c", "c d"]},
    {"question_id": 82, "category": "roleplay", "turns": ["b c d e"]},
    {"question_id": 161, "category": "translation", "turns": ["d e f a"]},
    {"question_id": 162, "category": "translation", "turns": ["f a b"]},
    {"question_id": 163, "category": "translation", "turns": ["a a b"]},  # past --limit 2
]


@pytest.fixture(scope="module")
def questions(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench") / "question.jsonl"
    path.write_text("\n".join(json.dumps(q) for q in QUESTIONS) + "\n")
    return path


def run_cli(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def bench_args(tiny_dirs, questions, out, *extra):
    return [
        "bench",
        "--target",
        str(tiny_dirs["target"]),
        "--questions",
        str(questions),
        "--subtasks",
        "mt_bench,translation",
        "--limit",
        "2",
        "--max-new-tokens",
        "6",
        "--out",
        str(out),
        "--no-progress",
        *extra,
    ]


@pytest.fixture(scope="module")
def full_run(tiny_dirs, questions, tmp_path_factory):
    """One greedy run with every kind of method, a proposer with no artifact for the target, and a results page."""
    root = tmp_path_factory.mktemp("run")
    methods = "none,draft,medusa"
    code, out, err = run_cli(
        *bench_args(
            tiny_dirs,
            questions,
            root / "out",
            "--proposers",
            methods,
            "--baselines",
            "hf,hf-assisted,hf-pld",
            "--results-doc",
            str(root / "docs" / "results.md"),
            f"draft.model={tiny_dirs['draft']}",
            "draft.num_speculative_tokens=3",
        )
    )
    assert code == 0, err
    return root, json.loads((root / "out" / "bench.json").read_text()), out, err


def test_outputs_exist_with_their_structure(full_run):
    root, doc, out, _ = full_run
    methods = ["none", "draft", "hf", "hf-assisted", "hf-pld"]
    assert list(doc["methods"]) == methods
    assert {
        "command",
        "date",
        "machine",
        "loadavg_start",
        "loadavg_end",
        "settings",
        "summary",
        "records",
        "skipped",
        "definitions",
    } <= set(doc)
    assert {"nproc", "cpu", "torch", "transformers"} <= set(doc["machine"])
    assert list(doc["summary"]) == ["mt_bench", "translation", "overall"]
    assert doc["settings"]["questions_run"] == {"mt_bench": 2, "translation": 2}  # --limit 2 per subtask
    for table in doc["summary"].values():
        assert list(table) == methods
        for s in table.values():
            assert {
                "mean_accepted_length",
                "tokens_per_s",
                "speedup_vs_hf",
                "speedup_vs_none",
                "acceptance_rate",
                "acceptance_by_position",
                "identity",
                "prediction",
            } <= set(s)
    assert len(doc["records"]) == 5 * len(methods)  # 4 questions, one with 2 turns
    assert doc["summary"]["overall"]["hf"]["speedup_vs_hf"] == pytest.approx(1.0)
    for name in ("bench.md", "speedup.png", "accepted_lengths.png"):
        assert (root / "out" / name).is_file()
    for png in ("speedup.png", "accepted_lengths.png"):
        assert (root / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (root / "out" / "bench.md").read_text()
    assert "| subtask | method |" in md and "| overall | draft |" in md and "## Skipped" in md
    assert re.search(r"\| overall \| draft \| 4 \|( [^|]* \|){3} [0-9.]+x \([0-9.]+-[0-9.]+\) \|", md)  # (its interval)
    assert "| subtask | method |" in out  # the table is also printed
    page = (root / "docs" / "results.md").read_text()
    assert "do not edit by hand" in page and doc["command"] in page and doc["machine"]["cpu"] in page
    assert "--results-doc" in doc["command"] and "draft.num_speculative_tokens=3" in doc["command"]


def test_every_markdown_table_row_has_its_header_s_cells(full_run):
    import copy

    from specframe.bench import markdown

    _, doc, _, _ = full_run
    doc = copy.deepcopy(doc)  # (with a row whose prediction does not apply, as a tree proposer's)
    doc["summary"]["overall"]["draft"]["prediction"] = {"applies": False, "why": "tree proposals: not a chain"}
    tables, rows = 0, markdown(doc).splitlines()
    for i, line in enumerate(rows):
        if line.startswith("|---") or line.startswith("|:--"):
            tables += 1
            width = rows[i - 1].count("|")
            body = [r for r in itertools.takewhile(lambda r: r.startswith("|"), rows[i + 1 :])]
            assert all(r.count("|") == width for r in body), (rows[i - 1], body)
    assert tables >= 3 and "tree proposals: not a chain" in markdown(doc)
    # the target line names an adapter merged into it (it was in the echoed command only)
    assert doc["settings"]["adapter"] == "" and "with adapter" not in markdown(doc)
    doc["settings"]["adapter"] = "runs/lora"
    assert "- target: `" in markdown(doc) and "` with adapter `runs/lora` merged (" in markdown(doc)


def test_render_remakes_the_report_from_the_json(full_run, tmp_path):
    root, doc, _, _ = full_run
    code, out, err = run_cli(
        "bench",
        "--render",
        str(root / "out" / "bench.json"),
        "--out",
        str(tmp_path),
        "--results-doc",
        str(tmp_path / "results.md"),
    )
    assert code == 0, err
    again = json.loads((tmp_path / "bench.json").read_text())
    assert again["summary"] == doc["summary"] and again["command"] == doc["command"]
    assert (tmp_path / "speedup.png").is_file() and doc["command"] in (tmp_path / "results.md").read_text()
    # (which of MT-bench's categories ran is said; a subtask of one category is not spelled out again)
    page = (tmp_path / "results.md").read_text()
    assert "- questions: mt_bench 2 (writing 1, roleplay 1), translation 2 (from" in page
    assert f"--render <out>/bench.json --results-doc {tmp_path / 'results.md'}` re-makes" in page
    code, _, err = run_cli("bench", "--render", str(tmp_path / "results.md"))
    assert code == 2 and "cannot read bench results" in err


def test_render_leaves_a_partial_file_and_rewrites_bench_json_whole(full_run, tmp_path, monkeypatch):
    import pathlib

    root, doc, _, _ = full_run
    (tmp_path / "bench.json").write_text((root / "out" / "bench.json").read_text())
    (tmp_path / "bench.partial.json").write_text('{"partial": true}')  # (another, stopped run's records)
    code, _, err = run_cli("bench", "--render", str(tmp_path / "bench.json"))
    assert code == 0 and (tmp_path / "bench.partial.json").is_file(), err  # (before: removed)
    source = (tmp_path / "bench.json").read_text()
    write_text = pathlib.Path.write_text

    def disk_full(path, *args, **kwargs):
        if path.name != "bench.json":
            return write_text(path, *args, **kwargs)
        path.open("w").close()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", disk_full)
    code, _, err = run_cli("bench", "--render", str(tmp_path / "bench.json"))
    assert code == 1 and "No space left on device" in err, err
    assert (tmp_path / "bench.json").read_text() == source  # (before: emptied, the run's records lost)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["bench.partial.json", *bench.REPORT_FILES])


def test_the_speedup_plot_needs_hf_or_none_and_leaves_missing_values_out(full_run, tmp_path, monkeypatch):
    import matplotlib.axes

    _, doc, _, _ = full_run
    bars = []  # (axes, label, heights) of each call
    bar = matplotlib.axes.Axes.bar

    def noted_bar(ax, x, height, *args, **kwargs):
        bars.append((ax, kwargs["label"], list(height)))
        return bar(ax, x, height, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "bar", noted_bar)
    # draft did not run on translation (say, a time limit stopped it): no bar there, not a bar of height 0
    cut = {**doc, "records": [r for r in doc["records"] if (r["method"], r["subtask"]) != ("draft", "translation")]}
    (tmp_path / "bench.json").write_text(json.dumps(cut))
    assert run_cli("bench", "--render", str(tmp_path / "bench.json"))[0] == 0
    again = json.loads((tmp_path / "bench.json").read_text())["summary"]
    speedup_axes = bars[0][0]
    drawn = [h for ax, label, h in bars if ax is speedup_axes and label == "draft"]
    assert drawn == [[again[s]["draft"]["speedup_vs_hf"] for s in ("mt_bench", "overall")]]
    # neither hf nor none ran: no speedup plot (before: one "over none", every bar 0), and none shown in bench.md
    methods = {m: v for m, v in doc["methods"].items() if m not in ("hf", "none")}
    records = [r for r in doc["records"] if r["method"] in methods]
    (tmp_path / "bench.json").write_text(json.dumps({**doc, "methods": methods, "records": records}))
    code, _, err = run_cli("bench", "--render", str(tmp_path / "bench.json"), "--results-doc", str(tmp_path / "r.md"))
    assert code == 0, err
    assert not (tmp_path / "speedup.png").exists() and (tmp_path / "accepted_lengths.png").is_file()
    md = (tmp_path / "bench.md").read_text()
    assert (
        "speedup.png" not in md
        and "accepted_lengths.png" in md
        and "speedup.png" not in (tmp_path / "r.md").read_text()
    )


def test_without_matplotlib_the_report_is_written_without_plots(full_run, tmp_path, monkeypatch):
    """matplotlib is the `bench` extra: without it the report and the results page are still written (before,
    the plots' import failed after the whole run, and the results page was lost), and an earlier run's plots in
    the folder are removed rather than left to read as this run's."""
    import specframe.bench as bench

    root, _, _, _ = full_run
    report = ("bench", "--render", str(root / "out" / "bench.json"), "--out", str(tmp_path))
    assert run_cli(*report)[0] == 0 and (tmp_path / "speedup.png").is_file()
    monkeypatch.setattr(bench, "plots_possible", lambda: False)
    code, _, err = run_cli(*report, "--results-doc", str(tmp_path / "results.md"))
    assert code == 0, err
    assert "matplotlib is not installed" in err and "pip install 'specframe[bench]'" in err
    assert not any((tmp_path / name).exists() for name in bench.PLOT_FILES)
    assert "## Plots" not in (tmp_path / "bench.md").read_text()
    page = (tmp_path / "results.md").read_text()  # (it names no plot files in the run's folder)
    assert "(`bench.json`, no plots: matplotlib was not installed;" in page and ".png" not in page


def test_proposer_without_an_artifact_is_skipped_with_a_reason(full_run):
    _, doc, _, err = full_run
    # installed, but no trained heads ship for this (tiny) target
    assert "no Medusa heads ship" in doc["skipped"]["medusa"]
    # the keys named are the bench's own (`medusa.model=...`), not generate's `proposer.model`
    assert (
        "medusa.model is required" in doc["skipped"]["medusa"]
        and "pass medusa.model=<folder>" in doc["skipped"]["medusa"]
    )


def test_no_draft_skips_draft_and_hf_assisted(tiny_dirs, questions, tmp_path):
    code, _, err = run_cli(
        *bench_args(
            tiny_dirs,
            questions,
            tmp_path,
            "--proposers",
            "none,draft",
            "--baselines",
            "hf-assisted",
            "--subtasks",
            "translation",
            "--limit",
            "1",
        )
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert list(doc["methods"]) == ["none"]
    assert "draft.model is required" in doc["skipped"]["draft"]
    assert doc["skipped"]["hf-assisted"].startswith("no draft model")


def test_shared_draft_serves_draft_and_hf_assisted(tiny_dirs, questions, tmp_path):
    from specframe.models import load_model
    from specframe.shared_draft import build_shared_draft, save_shared_draft

    target = load_model(tiny_dirs["target"], quiet=True).model
    vocab_ids = torch.arange(6)  # a reduced vocabulary: hf-assisted needs the full-vocabulary wrapper
    draft = build_shared_draft(target, 1, vocab_ids, init_layers=[0])
    save_shared_draft(draft, vocab_ids, target, tmp_path / "shared", init_layers=[0], metrics={})
    code, _, err = run_cli(
        *bench_args(
            tiny_dirs,
            questions,
            tmp_path / "out",
            "--proposers",
            "draft",
            "--baselines",
            "hf,hf-assisted",
            "--subtasks",
            "mt_bench",
            f"draft.model={tmp_path / 'shared'}",
            "draft.num_speculative_tokens=2",
        )
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert list(doc["methods"]) == ["draft", "hf", "hf-assisted"]
    assert "num_assistant_tokens=2" in doc["methods"]["hf-assisted"]["description"]
    for m in ("draft", "hf-assisted"):
        identity = doc["summary"]["overall"][m]["identity"]
        assert identity["compared"] >= 2 and identity["differ_not_tie"] == 0
    assert doc["summary"]["overall"]["draft"]["prediction"]["why"].startswith("needs `none`")


def test_float32_copy_leaves_the_target_alone():
    model = tiny_llama(vocab_size=8, seed=0).to(torch.bfloat16)
    copy32 = bench.float32_copy(model)
    assert next(copy32.parameters()).dtype == torch.float32 and next(model.parameters()).dtype == torch.bfloat16
    fp32 = tiny_llama(vocab_size=8, seed=0)
    assert bench.float32_copy(fp32) is fp32


def test_hf_baselines_ignore_the_target_s_generation_config_and_stop_at_its_window():
    """transformers fills unset generate() settings from the model's generation_config.json; a repetition penalty
    there made `hf` differ from the target's greedy output (and specframe look inexact). And transformers goes
    on past the context window, where specframe's decoder stops."""
    from specframe.decoder import SpeculativeDecoder, target_info
    from specframe.proposers.none import NoneConfig, NoneProposer

    model = tiny_llama(vocab_size=8, seed=0, max_position_embeddings=16)
    model.generation_config.repetition_penalty = 1.3
    model.generation_config.no_repeat_ngram_size = 1
    counter = bench.ForwardCounter(model)
    hf = bench.hf_method("hf", model, counter, [], bench.BenchOptions(), "plain")
    plain = SpeculativeDecoder(model, NoneProposer(NoneConfig(), target_info(model)))
    out = hf.run([1, 2, 3], 8, 0)
    assert out.token_ids == reference_greedy(model, [1, 2, 3], 8) == plain.generate([1, 2, 3], 8).token_ids
    assert model.generation_config.repetition_penalty == 1.3  # (the model's own config is put back)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]
    out = hf.run(prompt, 12, 0)
    assert len(out.token_ids) == 6 and out.token_ids == plain.generate(prompt, 12).token_ids
    with pytest.raises(BadInputError, match="context window is 16"):
        hf.run(list(range(8)) * 2, 4, 0)
    # forwards counted in transformers' runs only: no hook is left on the target, which would turn the lean
    # forward off for specframe's methods
    assert out.target_forwards == 6 and lean_forward_applies(model)


def test_plain_decoding_scores_one_and_matches_hf(full_run):
    _, doc, _, _ = full_run
    overall = doc["summary"]["overall"]
    for m in ("none", "hf"):
        assert overall[m]["mean_accepted_length"] == 1.0
    assert overall["none"]["identity"] == {
        "compared": 5,
        "identical": 5,
        "differ": 0,
        "differ_at_near_tie": 0,
        "differ_not_tie": 0,
        "context_differs": 0,
    }
    for m in ("draft", "hf-assisted", "hf-pld"):  # exact methods: identical, or differing only at a near-tie
        assert overall[m]["identity"]["differ_not_tie"] == 0
    assert overall["hf"]["identity"] is None  # the reference itself


def test_draft_stats_and_prediction(full_run):
    _, doc, _, _ = full_run
    s = doc["summary"]["overall"]["draft"]
    assert len(s["proposed_by_position"]) == 3 and s["proposed_by_position"][0] > 0
    assert sum(s["accepted_length_histogram"]) == s["target_forwards"] - s["turns"]  # steps = forwards - prefills
    p = s["prediction"]
    assert p["applies"] and p["gamma"] == 3 and 0.0 <= p["alpha"] <= 1.0 and p["predicted_speedup"] > 0


def test_second_turn_holds_the_methods_own_first_answer(full_run, tiny_dirs):
    from transformers import AutoTokenizer

    _, doc, _, _ = full_run
    tok = AutoTokenizer.from_pretrained(tiny_dirs["target"])
    for m in doc["methods"]:
        first, second = [r for r in doc["records"] if r["method"] == m and r["question_id"] == 81]
        answer = tok.decode(first["token_ids"], skip_special_tokens=True).strip()
        # No chat template: the conversation's turns are joined and encoded as plain text, as specframe does.
        assert second["prompt_tokens"] == len(tok("\n".join(["a b c", answer, "c d"]))["input_ids"])


def test_methods_are_interleaved_with_a_rotating_order(full_run):
    _, doc, _, _ = full_run
    firsts = []
    for r in doc["records"]:
        if not firsts or firsts[-1][0] != r["question_id"]:
            firsts.append((r["question_id"], r["method"]))
    assert [q for q, _ in firsts] == [81, 82, 161, 162]  # question by question, every method on each
    assert [m for _, m in firsts] == ["none", "draft", "hf", "hf-assisted"]


def test_sampling_reports_speed_not_identity(tiny_dirs, questions, tmp_path):
    code, _, err = run_cli(
        *bench_args(
            tiny_dirs,
            questions,
            tmp_path,
            "--proposers",
            "none",
            "--baselines",
            "hf",
            "--subtasks",
            "translation",
            "--limit",
            "1",
            "--temperature",
            "0.8",
            "--top-k",
            "5",
            "--seed",
            "3",
            "--threads",
            "1",
        )
    )
    assert code == 0, err
    doc = json.loads((tmp_path / "bench.json").read_text())
    assert doc["settings"]["torch_threads"] == 1 and "--threads 1" in doc["command"]
    s = doc["summary"]["overall"]
    assert s["none"]["tokens_per_s"] > 0 and s["none"]["identity"] is None
    report = (tmp_path / "bench.md").read_text()
    assert "--temperature 0.8" in doc["command"] and "sampling (temperature 0.8" in report
    assert "Sampled outputs are not compared with `hf`'s" in report and "`specframe check` tests" in report


def test_min_p_reaches_specframe_and_transformers(tiny_dirs, questions, tmp_path):
    # min_p 1 keeps only the top token: sampled at temperature 1.5, every method then gives the greedy tokens,
    # which it would not if the flag were dropped on the way to either
    common = ["--subtasks", "translation", "--limit", "1", "--max-new-tokens", "12", "--threads", "1"]
    common += ["--baselines", "hf,hf-assisted,hf-pld", f"draft.model={tiny_dirs['draft']}"]
    runs = {}
    for name, extra in (("greedy", []), ("min_p", ["--temperature", "1.5", "--min-p", "1"])):
        out = tmp_path / name
        code, _, err = run_cli(*bench_args(tiny_dirs, questions, out, "--proposers", "none,draft", *common, *extra))
        assert code == 0, err
        doc = json.loads((out / "bench.json").read_text())
        runs[name] = {(r["method"], r["turn"]): r["token_ids"] for r in doc["records"]}
    assert runs["min_p"] == runs["greedy"] and {m for m, _ in runs["greedy"]} == {
        "none",
        "draft",
        "hf",
        "hf-assisted",
        "hf-pld",
    }
    assert doc["settings"]["min_p"] == 1.0 and "--min-p 1.0" in doc["command"]
    assert "sampling (temperature 1.5, top-p 1.0, top-k 0, min-p 1.0)" in (tmp_path / "min_p" / "bench.md").read_text()


def test_penalties_reach_every_method_and_greedy_output_stays_transformers(tiny_dirs, questions, tmp_path):
    # (transformers' baselines: its own repetition penalty, presence and frequency through OutputPenalties)
    common = ["--subtasks", "translation", "--limit", "2", "--max-new-tokens", "12", "--threads", "1"]
    common += ["--proposers", "none,draft", "--baselines", "hf,hf-assisted,hf-pld", f"draft.model={tiny_dirs['draft']}"]
    runs = {}
    for name, extra in (
        ("plain", []),
        ("penalised", ["--repetition-penalty", "1.5", "--presence-penalty", "0.5", "--frequency-penalty", "1"]),
    ):
        out = tmp_path / name
        code, _, err = run_cli(*bench_args(tiny_dirs, questions, out, *common, *extra))
        assert code == 0, err
        doc = json.loads((out / "bench.json").read_text())
        runs[name] = {(r["method"], r["question_id"]): r["token_ids"] for r in doc["records"]}
        overall = doc["summary"]["overall"]  # (exact methods: identical to hf's, or differing at a near-tie only)
        assert overall["none"]["identity"]["identical"] == 2 and overall["none"]["identity"]["differ"] == 0, name
        assert all(overall[m]["identity"]["differ_not_tie"] == 0 for m in ("draft", "hf-assisted", "hf-pld")), name
    assert runs["penalised"] != runs["plain"] and len(runs["penalised"]) == 10
    assert doc["settings"]["presence_penalty"] == 0.5 and "--repetition-penalty 1.5" in doc["command"]
    report = (tmp_path / "penalised" / "bench.md").read_text()
    assert "greedy, repetition penalty 1.5, presence penalty 0.5, frequency penalty 1.0;" in report


def test_baselines_apply_presence_and_frequency_penalties_and_go_past_eos_with_ignore_eos():
    from specframe.decoder import SpeculativeDecoder, target_info
    from specframe.proposers.none import NoneConfig, NoneProposer

    model = tiny_llama(vocab_size=32, seed=3)
    plain = SpeculativeDecoder(model, NoneProposer(NoneConfig(), target_info(model)))
    prompt = [1, 2, 3, 4, 5, 1, 2, 3]
    options = bench.BenchOptions(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.7)
    hf = bench.hf_method("hf", model, bench.ForwardCounter(model), [], options, "plain")
    want = plain.generate(prompt, 20, repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.7)
    assert hf.run(prompt, 20, 0).token_ids == want.token_ids != plain.generate(prompt, 20).token_ids
    # an EOS the output reaches: both stop there, unless --ignore-eos
    eos = want.token_ids[4]
    plain.eos_ids = {eos}
    for ignore in (False, True):
        options = bench.BenchOptions(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.7)
        options.ignore_eos = ignore
        hf = bench.hf_method("hf", model, bench.ForwardCounter(model), [eos], options, "plain")
        ours = bench.specframe_method("none", plain, options, "plain")
        expected = want.token_ids if ignore else want.token_ids[: want.token_ids.index(eos) + 1]
        assert hf.run(prompt, 20, 0).token_ids == ours.run(prompt, 20, 0).token_ids == expected, ignore


def test_a_config_file_sets_options_and_flags_win(tiny_dirs, questions, tmp_path):
    import yaml

    settings = {
        "target": str(tiny_dirs["target"]),
        "questions": str(questions),
        "proposers": ["none"],
        "baselines": [],
        "subtasks": ["translation"],
        "limit": 1,
        "max_new_tokens": 5,
        "out": str(tmp_path / "from-file"),
        "progress": False,
        "overrides": ["target.dtype=bfloat16"],
    }
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(settings))
    code, _, err = run_cli(
        "bench", "--config", str(tmp_path / "bench.yaml"), "--max-new-tokens", "3", "--dtype", "float32",
        "target.fast_cpu_kernels=false",
    )  # fmt: skip
    assert code == 0, err
    doc = json.loads((tmp_path / "from-file" / "bench.json").read_text())
    s = doc["settings"]
    assert s["subtasks"] == ["translation"] and s["limit"] == 1 and s["max_new_tokens"] == 3  # (the flag won)
    assert s["dtype"] == "float32"  # (--dtype won over the file's target.dtype override)
    assert s["overrides"] == [
        "target.dtype=bfloat16",
        "target.fast_cpu_kernels=false",
    ]  # the file's, then the command line's
    (tmp_path / "bad.yaml").write_text("limits: 3\n")
    code, _, err = run_cli("bench", "--config", str(tmp_path / "bad.yaml"))
    assert code == 2 and f"--config {tmp_path / 'bad.yaml'}: limits: Key 'limits' not in 'BenchOptions'" in err, err
    # the file's key is named, not a flag the user did not give, nor a `bench.` key that cannot be typed
    for text, said in (("limit: 0\n", "limit must be an integer >= 1, got 0"),
                       ("subtasks: qa\n", "subtasks must be a list, e.g. subtasks=[qa], got 'qa'"),
                       # (its flag is --time-limit: the file was not named, the flag was)
                       ("time_limit_s: -5\n", "time_limit_s must be a finite number of seconds > 0, got -5"),
                       ("tie_threshold: .inf\n", "tie_threshold must be a finite number >= 0, got inf")):  # fmt: skip
        (tmp_path / "bad.yaml").write_text(text)
        code, _, err = run_cli("bench", "--config", str(tmp_path / "bad.yaml"))
        assert code == 2 and f"error: --config {tmp_path / 'bad.yaml'}: {said}" in err, err
    (tmp_path / "bad.yaml").write_text("limit: 3\n")
    code, _, err = run_cli("bench", "--config", str(tmp_path / "bad.yaml"), "--limit", "0")
    assert code == 2 and "error: --limit must be an integer >= 1, got 0" in err, err  # (the flag's own value)
    code, _, err = run_cli("bench", "--config", "eagle.yaml")  # (a packaged `generate` config)
    assert code == 2 and "--config eagle.yaml is a `specframe generate` config (it has target, proposer" in err, err


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--subtasks", "poetry"], "unknown subtask 'poetry'"),
        (["--subtasks", "qa,mt_bench,qa"], "--subtasks lists 'qa' twice"),
        (["--proposers", "none,none"], "--proposers lists 'none' twice"),
        (["--baselines", "hf,hf-pld,hf"], "--baselines lists 'hf' twice"),
        (["--questions", "/nonexistent/question.jsonl"], "questions file '/nonexistent/question.jsonl' does not exist"),
        (["--limit", "0"], "--limit must be an integer >= 1"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
        (["--baselines", "vllm"], "unknown baseline 'vllm'"),
        (["--proposers", "none,lookahead"], "unknown proposer 'lookahead'; installed:"),
        (["--proposers", "none", "--out", ""], "--out must name a folder"),
        (["--proposers", "none", "--questions", "/no/${where}.jsonl"], "questions file '/no/${where}.jsonl' does not"),
        (["--proposers", "none", "sampling.temperature=1"], "'sampling' is neither 'target' nor a proposer"),
        (["--proposers", "none", "--top-p", "0"], "--top-p must be a number in (0, 1]"),
        (["--proposers", "medusa", "--baselines", ""], "nothing to run: every method was skipped"),
        # an artifact named on the command line that cannot load ends the run (other methods would have run)
        (
            ["--proposers", "none,draft", "draft.model=/nonexistent/draft"],
            "draft: draft.model (the draft model): model path '/nonexistent/draft'",
        ),
        (
            ["--proposers", "none", "--baselines", "hf,hf-assisted", "draft.model=/no/d"],
            "draft: draft.model (the draft model): model path '/no/d'",
        ),
        (["--proposers", "none,union", "union.options.eagle.model=/no/e"], "union: union member 'eagle'"),
        (["--proposers", "none,draft", "draft.num_speculatve_tokens=3"], "draft.num_speculatve_tokens: Key"),
        (["--proposers", "none,draft", "draft.num_speculative_tokens=abc"], "draft.num_speculative_tokens: Value"),
        (["--proposers", "none,union", "union.options.ngram.bogus=1"], "union.options.ngram.bogus"),
        (  # (generate's spelling under bench's prefix: it was "proposer: Key 'proposer' not in 'UnionConfig'")
            ["--proposers", "none,union", "union.proposer.members=[ngram]"],
            "union: Key 'proposer' not in 'UnionConfig' (bench takes a proposer's keys as union.<key>",
        ),
        (["--seed", str(10**23), "--temperature", "1"], "--seed must be an integer in [-2**63, 2**63)"),
        (["--threads", str(10**20)], "--threads must be below 2**31"),  # (was torch's "Overflow", exit 1)
        (["--tie-threshold", "-1"], "--tie-threshold must be a finite number >= 0, got -1.0"),
        (["--tie-threshold", "inf"], "--tie-threshold must be a finite number >= 0, got inf"),  # (was accepted)
        (["--tie-threshold", "nan"], "--tie-threshold must be a finite number >= 0, got nan"),
        # a flag and an override that disagree (before: the flag won silently; the record held both)
        (["--proposers", "none", "--dtype", "float32", "target.dtype=bfloat16"], "--dtype float32 and the override"),
        (["--proposers", "none", "target.model=/elsewhere"], "and the override target.model=/elsewhere set target"),
    ],
)
def test_bad_input_exits_2_with_one_line(tiny_dirs, questions, tmp_path, extra, message):
    args = bench_args(tiny_dirs, questions, tmp_path, *extra)
    if "--questions" in extra:  # the later flag wins in argparse; drop the default one
        i = args.index("--questions")
        del args[i : i + 2]
    code, out, err = run_cli(*args)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err, err


def test_render_of_a_damaged_bench_json_names_the_file(full_run, tmp_path):
    root, _, _, _ = full_run
    doc = json.loads((root / "out" / "bench.json").read_text())
    del doc["records"][0]["subtask"]
    (tmp_path / "bad.json").write_text(json.dumps(doc))
    (tmp_path / "bytes.json").write_bytes(b"\xff\xfe")
    doc = json.loads((root / "out" / "bench.json").read_text())
    del doc["loadavg_start"]  # (read only by the Markdown pages: checked before anything is written)
    (tmp_path / "no-load.json").write_text(json.dumps(doc))
    for name, message in (("bad.json", "is an incomplete or damaged bench.json (KeyError: 'subtask')"),
                          ("bytes.json", "cannot read bench results"),
                          ("no-load.json", "damaged bench.json (KeyError: 'loadavg_start')")):  # fmt: skip
        code, _, err = run_cli("bench", "--render", str(tmp_path / name), "--out", str(tmp_path / "o"))
        assert code == 2 and message in err, err
    assert not (tmp_path / "o").exists()


def test_render_takes_only_where_to_write(full_run, tmp_path, monkeypatch):
    root, _, _, _ = full_run
    source = str(root / "out" / "bench.json")
    for extra, named in ((["--proposers", "none"], "not --proposers"), (["--limit", "1"], "not --limit"),
                         (["draft.x=1"], "not KEY=VALUE overrides")):  # fmt: skip
        code, _, err = run_cli("bench", "--render", source, "--out", str(tmp_path / "o"), *extra)
        assert code == 2 and "--render re-makes the report" in err and named in err, err
    monkeypatch.chdir(tmp_path)  # (an empty --out would write the report here)
    code, _, err = run_cli("bench", "--render", source, "--out", "")
    assert code == 2 and "--out must name a folder" in err and not list(tmp_path.iterdir()), err
    # --results-doc may not overwrite the report's own files (then its records would be lost)
    code, _, err = run_cli(
        "bench", "--render", source, "--out", str(tmp_path / "o"), "--results-doc", str(tmp_path / "o" / "bench.json")
    )
    assert code == 2 and "is one of the report's own files" in err, err
    # nor be the --out folder itself (found only at the end, "[Errno 21] Is a directory", exit 1)
    code, _, err = run_cli(
        "bench", "--render", source, "--out", str(tmp_path / "o2"), "--results-doc", str(tmp_path / "o2")
    )
    assert code == 2 and "is the --out folder: name a Markdown file" in err and not (tmp_path / "o2").exists(), err


def test_a_time_limit_stops_between_questions_and_says_so(tiny_dirs, questions, tmp_path):
    out = tmp_path / "out"
    code, _, err = run_cli(
        *bench_args(tiny_dirs, questions, out, "--proposers", "none", "--baselines", "", "--time-limit", "1e-9")
    )
    assert code == 0, err
    doc = json.loads((out / "bench.json").read_text())
    # the first question always runs; then the limit has passed, so 1 of the 4 planned (2 per subtask) ran
    assert doc["settings"]["questions_run"] == {"mt_bench": 1, "translation": 0}
    assert doc["settings"]["questions_planned"] == 4 and doc["settings"]["time_limit_s"] == 1e-9
    assert "--time-limit 1e-09" in doc["command"]
    assert "stopped by the time limit (1e-09 s) after 1 of 4 questions" in (out / "bench.md").read_text()
    assert "stopped after 1 of 4 questions" in err


def test_subtasks_in_turn_interleaves_and_keeps_each_subtasks_order():
    from specframe.bench import Question, subtasks_in_turn

    qs = [Question(i, s, s, ["t"]) for i, s in enumerate(["a", "a", "a", "b", "c", "c"])]
    assert [q.question_id for q in subtasks_in_turn(qs)] == [0, 3, 4, 1, 5, 2]
    assert subtasks_in_turn([]) == []


@pytest.mark.parametrize("value", ["0", "-3", "nan", "inf"])
def test_time_limit_must_be_positive(tiny_dirs, questions, tmp_path, value):
    code, _, err = run_cli(*bench_args(tiny_dirs, questions, tmp_path / "out", f"--time-limit={value}"))
    assert code == 2 and "--time-limit must be a finite number of seconds > 0" in err, err


def test_question_ids_must_be_unique(tiny_dirs, tmp_path):
    twice = tmp_path / "q.jsonl"
    rows = [QUESTIONS[0], {**QUESTIONS[1], "question_id": QUESTIONS[0]["question_id"]}]
    twice.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, _, err = run_cli(*bench_args(tiny_dirs, twice, tmp_path / "out"))
    assert code == 2 and "line 2: question_id" in err and "also on line 1" in err, err


def test_a_run_where_every_method_failed_is_an_error_not_an_empty_report():
    from types import SimpleNamespace

    from specframe.bench import BenchOptions, timed_loop

    def broken(*args):
        raise ValueError("broken")

    setup = SimpleNamespace(
        methods=[SimpleNamespace(name="a", run=broken), SimpleNamespace(name="b", run=broken)],
        encoder=SimpleNamespace(encode=lambda text: torch.tensor([1, 2])),
    )
    tqdm = lambda **kwargs: contextlib.nullcontext()  # noqa: E731  (never entered: the warm-up failed)
    with pytest.raises(RuntimeError, match="every method failed: a failed in warm-up: ValueError: broken; b failed"):
        timed_loop(setup, [], BenchOptions(proposers=[], baselines=[]), lambda line: None, tqdm)


def test_bad_question_file_names_the_line(tiny_dirs, tmp_path):
    bad = tmp_path / "q.jsonl"
    bad.write_text(json.dumps(QUESTIONS[0]) + "\n{not json\n")
    code, _, err = run_cli(*bench_args(tiny_dirs, bad, tmp_path / "out"))
    assert code == 2 and "line 2" in err


@pytest.mark.parametrize(
    "change, message",
    [({"turns": "What is AI?"}, "turns must be a list of strings, got 'What is AI?'"),  # (was 11 one-letter turns)
     ({"turns": ["a", None]}, "turns must be a list of strings"),
     ({"question_id": True}, "question_id must be an integer, got True"),
     ({"question_id": "7"}, "question_id must be an integer"),
     ({"category": 3}, "category must be a string")],
)  # fmt: skip
def test_a_question_s_fields_must_have_their_types(tmp_path, change, message):
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps(QUESTIONS[0]) + "\n" + json.dumps({**QUESTIONS[0], "question_id": 99, **change}))
    with pytest.raises(BadInputError, match=rf"q.jsonl' line 2: {re.escape(message)}"):
        bench.read_questions(path, ["mt_bench"])


def test_questions_of_no_spec_bench_category_are_named_and_a_missing_subtask_points_to_subtasks(tmp_path):
    # (before: a category such as "chat" was dropped without a word; a file without mt_bench did not say --subtasks)
    path = tmp_path / "q.jsonl"
    rows = [
        {**QUESTIONS[0], "question_id": 1, "category": "chat"},
        {**QUESTIONS[0], "question_id": 2, "category": "qa"},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    said: list[str] = []
    assert [q.question_id for q in bench.read_questions(path, ["qa"], log=said.append)] == [2]
    assert len(said) == 1 and "note: 1 question in" in said[0] and "left out: 'chat' (1)" in said[0], said
    with pytest.raises(BadInputError, match=r"no question of subtask 'mt_bench'; --subtasks chooses .* has qa\)$"):
        bench.read_questions(path, ["mt_bench", "qa"])


# ------------------------------------------------------------------------------------------------ the maths


def rec(qid, new, forwards, seconds, stats=None, method="m", subtask="qa"):
    return {
        "method": method,
        "question_id": qid,
        "subtask": subtask,
        "new_tokens": new,
        "target_forwards": forwards,
        "seconds": seconds,
        "stats": stats,
        "identical": None,
        "context_differs": None,
        "difference": None,
    }


def test_mean_accepted_length_pools_tokens_over_forwards():
    rs = [rec(1, 10, 5, 1.0), rec(2, 30, 10, 1.0)]
    assert bench.mean_accepted_length(rs) == 40 / 15  # not the mean of 2.0 and 3.0
    assert bench.mean_accepted_length([]) is None


def test_tokens_per_second_is_the_mean_of_per_question_speeds():
    # question 1 has two turns: (10 + 20) tokens / (1 + 2) s = 10/s; question 2: 40 tokens / 1 s.
    rs = [rec(1, 10, 10, 1.0), rec(1, 20, 20, 2.0), rec(2, 40, 40, 1.0)]
    assert bench.tokens_per_second(rs) == pytest.approx((10 + 40) / 2)


def test_pooled_stats_and_positions():
    s1 = {
        "proposed_tokens": 6,
        "accepted_tokens": 3,
        "proposed_nodes": 6,
        "propose_time_s": 0.6,
        "verify_time_s": 0.3,
        "proposed_by_position": [2, 2, 2],
        "accepted_by_position": [2, 1],
    }
    s2 = {
        "proposed_tokens": 1,
        "accepted_tokens": 1,
        "proposed_nodes": 1,
        "propose_time_s": 0.1,
        "verify_time_s": 0.1,
        "proposed_by_position": [1],
        "accepted_by_position": [1],
    }
    pooled = bench.pooled_stats([rec(1, 6, 3, 1.0, s1), rec(2, 3, 2, 1.0, s2), rec(3, 5, 5, 1.0)])
    assert pooled["proposed_by_position"] == [3, 2, 2] and pooled["accepted_by_position"] == [3, 1]
    assert pooled["steps"] == (3 - 1) + (2 - 1) and pooled["decode_tokens"] == 5 + 2
    assert pooled["proposed_tokens"] == 7 and pooled["accepted_tokens"] == 4
    assert bench.acceptance_by_position([3, 2, 2], [3, 1]) == [1.0, 0.5, 0.0]
    assert bench.acceptance_by_position([2, 0], [1]) == [0.5, None]
    assert bench.pooled_stats([rec(1, 5, 5, 1.0)]) is None  # transformers: no stats


def test_accepted_length_histogram():
    # 10 steps; 6 accepted >= 1 draft, 3 accepted >= 2, 1 accepted all 3.
    assert bench.accepted_length_histogram(10, [6, 3, 1]) == [4, 3, 2, 1]
    assert bench.accepted_length_histogram(4, []) == [4]


def test_predicted_speedup_on_known_numbers():
    # Leviathan et al. eq. 1 with alpha 0.8, gamma 4: (1 - 0.8^5) / 0.2 = 3.3616 tokens per step.
    assert bench.expected_tokens_per_step(0.8, 4) == pytest.approx(3.3616)
    assert bench.expected_tokens_per_step(1.0, 4) == 5.0 and bench.expected_tokens_per_step(0.0, 4) == 1.0
    # One step costs 4 x 0.1 (drafts) + 1.2 (verify) = 1.6 plain steps.
    assert bench.predicted_speedup(0.8, 4, 0.1, 1.2, 1.0) == pytest.approx(3.3616 / 1.6)


def test_alpha_estimate():
    # gamma 3, 10 steps, 6 + 3 + 1 accepted, 1 step accepted all: 9 rejections -> alpha = 10 / 19.
    assert bench.estimate_alpha(10, [10, 10, 10], [6, 3, 1]) == pytest.approx(10 / 19)
    assert bench.estimate_alpha(30, [10, 10, 10], [10, 10, 10]) == 1.0
    assert bench.estimate_alpha(0, [], []) is None


def test_prediction_needs_a_chain_and_none():
    chain = {
        "proposed_tokens": 8,
        "accepted_tokens": 4,
        "proposed_nodes": 8,
        "propose_time_s": 0.8,
        "verify_time_s": 1.0,
        "steps": 4,
        "decode_tokens": 8,
        "proposed_by_position": [4, 4],
        "accepted_by_position": [3, 1],
    }
    plain = {"propose_time_s": 0.0, "verify_time_s": 2.0, "steps": 10, "decode_tokens": 10}
    p = bench.prediction(chain, plain)
    alpha = 4 / (4 + 3)  # 4 steps, 1 accepted both: 3 rejections
    assert p["alpha"] == pytest.approx(alpha) and p["gamma"] == 2
    assert p["predicted_speedup"] == pytest.approx(bench.expected_tokens_per_step(alpha, 2) * 0.2 / (2 * 0.1 + 0.25))
    assert p["measured_tokens_per_step"] == 2.0
    assert p["measured_loop_speedup"] == pytest.approx((8 / 1.8) / (10 / 2.0))
    assert not bench.prediction({**chain, "proposed_nodes": 12}, plain)["applies"]  # a tree
    assert not bench.prediction(chain, None)["applies"]
    # A chain whose depth varies (here: 1 and 4 in turn, every draft accepted, 40 steps of one turn) is not
    # predicted: α would read 21 / 26 for an α of 1, and γ = 4 would be assumed every step.
    varied = {**chain, "steps": 40, "turns": 1, "proposed_by_position": [40, 20, 20, 20]}
    varied |= {"accepted_by_position": [40, 20, 20, 20], "proposed_tokens": 100, "proposed_nodes": 100}
    p = bench.prediction(varied, plain)
    assert not p["applies"] and "depth varied: 20 of 40 steps drafted fewer than its deepest 4" in p["why"]
    # ... but the few shorter steps at each turn's end are allowed (here 5 of 2 turns: at most 2 x (4 + 1))
    assert bench.prediction({**varied, "turns": 2, "proposed_by_position": [39, 38, 36, 35]}, plain)["applies"]


def test_summarize_speedups_and_identity():
    def both(method, speed):
        return [rec(1, speed, speed, 1.0, method=method), rec(2, speed, speed, 1.0, method=method)]

    records = both("hf", 10) + both("none", 20) + both("x", 40)
    records[-1].update(identical=False, difference={"near_tie": True})
    records[-2].update(identical=True)
    table = bench.summarize(records, ["hf", "none", "x"], ["qa"])["overall"]
    assert table["x"]["speedup_vs_hf"] == 4.0 and table["x"]["speedup_vs_none"] == 2.0
    assert table["x"]["identity"]["differ_at_near_tie"] == 1 and table["x"]["identity"]["identical"] == 1
    assert table["x"]["speedup_vs_none_interval"] is None  # (two questions: too few to resample)


def test_the_speedup_interval_resamples_questions_in_pairs():
    def run(method, rates):  # one turn per question, 10 tokens at each question's rate
        return [rec(q, 10, 10, 10 / rate, method=method) for q, rate in enumerate(rates)]

    same = run("none", [10, 20, 40, 80]) + run("x", [20, 40, 80, 160])  # 2x on every question
    assert bench.speedup_interval(same, "x", "none") == pytest.approx([2.0, 2.0])
    mixed = run("none", [10, 10, 10, 10, 10]) + run("x", [10, 12, 14, 16, 30])
    low, high = bench.speedup_interval(mixed, "x", "none")
    assert 1.0 <= low < bench.summarize(mixed, ["none", "x"], ["qa"])["overall"]["x"]["speedup_vs_none"] < high <= 3.0
    assert bench.speedup_interval(mixed, "x", "none") == [low, high]  # (seeded)
    assert bench.speedup_interval(mixed[:2] + mixed[5:7], "x", "none") is None
    numbers = {"speedup_vs_none_interval": [low, high]}
    assert (
        bench.interval_cell(numbers, "x") == f" ({low:.2f}-{high:.2f})" and bench.interval_cell(numbers, "none") == ""
    )


# ------------------------------------------------------------------------------------------------ identity


def test_first_difference():
    assert bench.first_difference([1, 2, 3], [1, 2, 3]) is None
    assert bench.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert bench.first_difference([1, 2, 3], [1, 2]) == 2


def test_near_tie_from_the_targets_logits():
    model = tiny_llama(vocab_size=8, seed=0)
    context = [1, 2, 3]
    (t1, l1), (t2, l2) = bench.top2_logits(model, context)
    assert l1 >= l2 and t1 != t2
    assert bench.is_near_tie(10.0, 9.995, 1e-3) and not bench.is_near_tie(10.0, 9.9, 1e-3)
    gap = bench.explain_difference(model, context, [t1], [t2], 0, 1e-3)
    assert gap["reference_token"] == t1 and gap["method_token"] == t2 and gap["gap"] == pytest.approx(l1 - l2)
    # Give the runner-up the winner's output row: an exact tie, which the check must call a near-tie.
    with torch.no_grad():
        model.lm_head.weight[t2] = model.lm_head.weight[t1]
    tie = bench.explain_difference(model, context, [t1], [t2], 0, 1e-3)
    assert tie["gap"] == 0.0 and tie["near_tie"]
    # with penalties, the top-2 greedy decoding chose between: penalised (t1 in the output loses 2 of its logit)
    from specframe import SamplingParams

    with torch.no_grad():
        raw = model(input_ids=torch.tensor([context + [t1]])).logits[0, -1]
    raw[t1] -= 2.0
    (w1, v1), (w2, v2) = [(int(i), float(v)) for v, i in zip(*raw.topk(2), strict=True)]
    pen = bench.explain_difference(model, context, [t1, w1], [t1, w2], 1, 1e-3, SamplingParams(presence_penalty=2.0))
    far = bench.explain_difference(model, context, [t1, w1], [t1, w2], 1, 1e-3, SamplingParams(frequency_penalty=2.0))
    assert pen["top1"]["token"] == far["top1"]["token"] == w1 and pen["gap"] == pytest.approx(v1 - v2, abs=1e-5)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(torch.float32, 1e-3), (torch.bfloat16, 2**-7), (torch.float16, 1e-3)],  # (float16: eps 2**-10 < 1e-3)
)
def test_a_16_bit_target_s_near_ties_reach_its_dtype_s_rounding(dtype, expected):
    # a bfloat16 logit of 20 is rounded in steps of 0.125: a verification and transformers' one-token steps
    # round differently, so gaps of that size are near-ties there, not in float32 (the flag's 1e-3 stays a floor)
    model = tiny_llama(vocab_size=8, seed=0).to(dtype)
    assert bench.tie_threshold(model, bench.BenchOptions()) == expected
    assert bench.tie_threshold(model, bench.BenchOptions(tie_threshold=0.5)) == 0.5


def test_top_k_minus_one_is_off_and_reaches_transformers_as_0():
    # (transformers' generate refuses top_k=-1; the bench hands it 0, the same transform)
    options = bench.BenchOptions(proposers=["none"], temperature=0.5, top_k=-1)
    options.validate()
    assert options.top_k == 0
    with pytest.raises(BadInputError, match=r"^--top-k must be an integer >= 1, or 0 or -1 for off, got -3"):
        bench.BenchOptions(proposers=["none"], temperature=0.5, top_k=-3).validate()
    with pytest.raises(BadInputError, match=r"^--min-p must be a number in \[0, 1\] \(0 = off\), got 1.5"):
        bench.BenchOptions(proposers=["none"], temperature=0.5, min_p=1.5).validate()
    with pytest.raises(BadInputError, match=r"^--repetition-penalty must be a finite number > 0 \(1 = off\), got 0"):
        bench.BenchOptions(proposers=["none"], repetition_penalty=0).validate()
    with pytest.raises(BadInputError, match=r"^--frequency-penalty must be a number in \[-2, 2\] \(0 = off\)"):
        bench.BenchOptions(proposers=["none"], frequency_penalty=2.5).validate()
    with pytest.raises(BadInputError, match=r"^--ignore-eos must be true or false, got 'yes'"):
        bench.BenchOptions(proposers=["none"], ignore_eos="yes").validate()


def test_outputs_that_cannot_be_written_are_refused_before_the_run(tiny_dirs, questions, tmp_path):
    # (before: the whole run, then exit 1 at the end, with nothing or only part of it saved)
    (tmp_path / "file").write_text("")
    (tmp_path / "folder").mkdir()
    code, _, err = run_cli(*bench_args(tiny_dirs, questions, tmp_path / "file", "--proposers", "none"))
    assert code == 2 and "--out '" in err and "file' is a file; it must name a folder" in err, err
    args = bench_args(tiny_dirs, questions, tmp_path / "o", "--proposers", "none", "--results-doc")
    code, _, err = run_cli(*args, str(tmp_path / "folder"))
    assert code == 2 and "folder' is a folder; it must name a file" in err and not (tmp_path / "o").exists(), err
    code, _, err = run_cli("bench", "--render", str(tmp_path / "x.json"), "--results-doc", str(tmp_path / "folder"))
    assert code == 2 and "--results-doc" in err and "is a folder" in err, err


def test_hf_assisted_runs_target_and_assistant_on_the_stock_kernels(monkeypatch):
    """transformers' baselines run as a transformers user gets them, the assistant included (a float32 draft
    loaded by specframe has its CPU kernels), and the draft has them back afterwards."""
    from specframe.bench import BenchOptions, ForwardCounter, hf_assistant, hf_method
    from specframe.cpu_kernels import fast_kernels_on, use_fast_cpu_kernels

    monkeypatch.setattr("specframe.cpu_kernels.layout_choice", "few-rows")  # (every layer rerouted, then put back)
    target, draft_model = tiny_llama(vocab_size=16, hidden_size=32), tiny_llama(vocab_size=16, hidden_size=32, seed=1)
    use_fast_cpu_kernels(target)
    use_fast_cpu_kernels(draft_model)
    assistant, _ = hf_assistant(types.SimpleNamespace(gamma=2, model=draft_model), 16)
    seen = []

    def generate(**kwargs):
        models = (target, kwargs["assistant_model"])
        seen.append([("forward" in m.lm_head.__dict__, m.config._attn_implementation) for m in models])
        return torch.cat([kwargs["input_ids"], kwargs["input_ids"][:, :1]], 1)

    monkeypatch.setattr(target, "generate", generate)
    method = hf_method("hf-assisted", target, ForwardCounter(target), [], BenchOptions(), "", assistant_model=assistant)
    method.run([1, 2, 3], 4, 0)
    assert seen == [[(False, "sdpa"), (False, "sdpa")]]
    assert fast_kernels_on(target) and fast_kernels_on(draft_model) and "forward" in draft_model.lm_head.__dict__
    assert draft_model.config._attn_implementation == "specframe_sdpa"


def test_overrides_go_to_the_target_or_their_proposer():
    from specframe.bench import split_overrides

    shared, own = split_overrides(["target.dtype=float32", "eagle.depth=2", r"eagle.a\=b=x=1"], ["eagle", "none"])
    assert shared == ["target.dtype=float32"]
    assert own == {"eagle": ["proposer.depth=2", r"proposer.a\=b=x=1"]}  # split at the first unescaped '='
    for item, named in (("eagle.depth", "not KEY=VALUE"), ("depth=2", "not KEY=VALUE"),
                        ("medusa.depth=2", "'medusa' is neither 'target' nor a proposer of this run")):  # fmt: skip
        with pytest.raises(BadInputError, match=named):
            split_overrides([item], ["eagle"])


def test_a_proposer_two_plugins_register_or_a_missing_default_plugin_is_named(monkeypatch):
    from specframe import plugins

    registry = plugins.build_registry()
    registry.contested["echo"] = "plugin 'a' (a-dist) and plugin 'b' (b-dist)"
    registry.proposers.pop("ngram", None)  # (as without the specframe-ngram plugin)
    registry.contested.pop("ngram", None)
    monkeypatch.setattr(plugins, "_registry", registry)
    cases = (
        (["none", "echo"], "proposer 'echo' is registered by two plugins"),  # (was "unknown proposer")
        (list(bench.DEFAULT_PROPOSERS), "'ngram' comes from the specframe-ngram plugin"),
    )
    for proposers, message in cases:
        with pytest.raises(BadInputError, match=message):
            bench.BenchOptions(proposers=proposers, out="/tmp/unused-bench-out").validate()


def test_a_prompt_past_the_context_window_is_named_before_any_question_runs(tiny_dirs, tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [QUESTIONS[0], {"question_id": 7, "category": "writing", "turns": ["a b c d e f g h"]}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["bench", "--target", str(tiny_dirs["short"]), "--questions", str(path), "--subtasks", "mt_bench"]
    code, _, err = run_cli(*args, "--proposers", "none", "--baselines", "", "--out", str(tmp_path / "out"))
    # (before: question 81 ran, then "the prompt has 8 tokens", with no question named)
    assert code == 2 and "question 7 (mt_bench): the prompt has 8 tokens; the target's context window is 8" in err, err
    assert not (tmp_path / "out").exists()


def test_a_run_that_stops_early_keeps_the_records_made_so_far(tiny_dirs, tmp_path):
    path = tmp_path / "q.jsonl"
    rows = [
        {"question_id": 1, "category": "writing", "turns": ["a"]},
        {"question_id": 2, "category": "writing", "turns": ["a", "b c d e f g h"]},  # (turn 2 past the window)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    args = ["bench", "--target", str(tiny_dirs["short"]), "--questions", str(path), "--subtasks", "mt_bench"]
    code, _, err = run_cli(*args, "--proposers", "none", "--baselines", "", "--max-new-tokens", "2", "--out", str(out))
    assert code == 2 and "question 2 turn 2, none: the prompt has" in err, err
    # (before: the error, and nothing of what had been timed)
    partial = json.loads((out / "bench.partial.json").read_text())
    assert partial["partial"] and [(r["question_id"], r["turn"]) for r in partial["records"]] == [(1, 0), (2, 0)]
    assert "prompt_ids" not in partial["records"][0] and "stopped early: the 2 records" in err
    assert "an earlier run's report" not in err
    # a report of an earlier run in the same folder is said not to be this run's (it stays, as the user's)
    (out / "bench.json").write_text("{}")
    code, _, err = run_cli(*args, "--proposers", "none", "--baselines", "", "--max-new-tokens", "2", "--out", str(out))
    assert code == 2 and f"note: {out / 'bench.json'} beside it is an earlier run's report, not this run's" in err


def test_a_failure_after_the_timed_runs_keeps_their_records(tiny_dirs, questions, tmp_path, monkeypatch):
    # (before: only the timed loop's failures kept them; the identity check's float32 copy of the target running
    # out of memory, or Ctrl-C while the report was written, lost every record)
    def out_of_memory(*args):
        raise MemoryError("no room for the float32 copy")

    monkeypatch.setattr(bench, "check_identity", out_of_memory)
    out = tmp_path / "out"
    args = bench_args(tiny_dirs, questions, out, "--proposers", "none", "--baselines", "hf")
    code, _, err = run_cli(*args)
    assert code == 1 and "error: no room for the float32 copy" in err and "stopped early: the 10 records" in err, err
    partial = json.loads((out / "bench.partial.json").read_text())
    assert sorted({r["method"] for r in partial["records"]}) == ["hf", "none"] and len(partial["records"]) == 10
    monkeypatch.undo()

    def interrupted(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "write_plots", interrupted)
    (out / "bench.partial.json").unlink()
    code, _, err = run_cli(*args)
    assert code == 130 and "stopped early: the 10 records" in err, err
    assert len(json.loads((out / "bench.partial.json").read_text())["records"]) == 10
    assert not (out / "bench.json").exists()  # (written last: a bench.json is a whole report)


def test_a_failed_method_s_records_are_not_in_the_partial_file(tmp_path):
    # (before: a method dropped on a later question kept its earlier records there until the loop's end, so a run
    # stopped after it saved them as if the method had run, not saying it failed)
    from specframe.bench import BenchOptions, Question, save_partial, timed_loop

    setup = stub_setup(["x", "y"], [])
    runs = {"x": setup.methods[0].run, "y": setup.methods[1].run}
    calls = {"x": 0, "y": 0}

    def failing(name, after, error):
        def run(*args):
            calls[name] += 1
            if calls[name] > after:
                raise error
            return runs[name](*args)

        return run

    setup.methods[0].run = failing("x", 2, RuntimeError("plugin broke"))  # (the warm-up, then question 1)
    setup.methods[1].run = failing("y", 3, KeyboardInterrupt())  # (the warm-up, questions 1 and 2)
    questions = [Question(i, "qa", "qa", ["t"]) for i in range(4)]
    options = BenchOptions(proposers=[], baselines=[], progress=False, out=str(tmp_path))
    made, failed = [], {}
    with pytest.raises(KeyboardInterrupt):
        timed_loop(setup, questions, options, lambda line: None, tqdm, made, failed)
    assert [(r["method"], r["question_id"]) for r in made] == [("y", 0), ("y", 1)]
    assert failed == {"x": "failed on question 1: RuntimeError: plugin broke"}
    partial = json.loads(save_partial(made, failed, options).read_text())
    assert partial["failed"] == failed and {r["method"] for r in partial["records"]} == {"y"}


def test_the_warm_up_prompt_is_named_when_it_does_not_fit():
    # (before: "the prompt has 3 tokens; ...", read as about the user's questions)
    from specframe.bench import BenchOptions, Question, timed_loop

    setup = stub_setup(["x"], [])
    encode = setup.encoder.encode

    def short_window(text, **kw):
        if text == bench.WARMUP_PROMPT:
            raise BadInputError("the prompt has 3 tokens; the target's context window is 3")
        return encode(text, **kw)

    setup.encoder.encode = short_window
    options = BenchOptions(proposers=[], baselines=[], progress=False)
    with pytest.raises(BadInputError, match="^the benchmark's warm-up prompt 'Say hello.': the prompt has 3 tokens"):
        timed_loop(setup, [Question(1, "qa", "qa", ["t"])], options, lambda line: None, tqdm)


def test_turns_cut_by_the_context_window_are_said_so(tiny_dirs, tmp_path):
    # (before: each turn stopped at the window without a word, the report saying max_new_tokens as asked)
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": ["b"]}) + "\n")  # (no EOS: 7 new)
    out = tmp_path / "out"
    args = ["bench", "--target", str(tiny_dirs["short"]), "--questions", str(path), "--subtasks", "mt_bench"]
    code, _, err = run_cli(*args, "--proposers", "none", "--baselines", "", "--max-new-tokens", "50", "--out", str(out))
    assert code == 0 and "note: 1 of 1 turns stopped at the target's context window before --max-new-tokens 50" in err
    doc = json.loads((out / "bench.json").read_text())
    assert doc["turns_cut_by_context_window"] == 1 and doc["records"][0]["new_tokens"] < 50
    assert "1 turns stopped at the target's context window" in (out / "bench.md").read_text()
    code, _, err = run_cli(*args, "--proposers", "none", "--baselines", "", "--max-new-tokens", "2", "--out", str(out))
    assert (
        code == 0
        and "context window" not in err
        and json.loads((out / "bench.json").read_text())["turns_cut_by_context_window"] == 0
    )


def test_sampling_flags_at_temperature_0_are_said_to_do_nothing(tmp_path):
    from dataclasses import replace

    # (before: `bench --top-p 0.5` ran greedily without a word, and the record held top_p 0.5 beside greedy)
    said = []
    options = bench.BenchOptions(
        proposers=["none"], baselines=[], top_p=0.5, top_k=4, min_p=0.1, questions=str(tmp_path / "no.jsonl")
    )
    with pytest.raises(BadInputError, match="does not exist"):  # (stopped right after the note: no model loads)
        bench.run_bench(options, log=said.append)
    assert said == ["note: --top-p, --top-k and --min-p have no effect at temperature 0 (greedy decoding)"]
    said.clear()
    with pytest.raises(BadInputError, match="does not exist"):
        bench.run_bench(replace(options, temperature=1.0), log=said.append)
    assert said == []


# (tests from a mutation review, 2026-12-06: each fails on the mutation it was written for)


def test_near_ties_of_small_logits_use_a_floor_of_one():
    assert bench.is_near_tie(0.1, 0.1 - 5e-4, 1e-3)  # gap 5e-4 <= 1e-3 x max(1, 0.1)
    assert not bench.is_near_tie(0.1, 0.098, 1e-3)


def test_a_turn_after_a_difference_is_not_compared():
    class S:
        model = tiny_llama(vocab_size=8, seed=0)

    def r(method, turn, prompt, out):
        return {
            "method": method,
            "question_id": 1,
            "turn": turn,
            "prompt_ids": prompt,
            "token_ids": out,
            "identical": None,
            "context_differs": None,
            "difference": None,
        }

    recs = [
        r("hf", 0, [1], [2, 3]),
        r("hf", 1, [1, 2, 3, 4], [5]),
        r("x", 0, [1], [2, 6]),
        r("x", 1, [1, 2, 6, 4], [5]),
    ]
    bench.check_identity(recs, S(), 1e-3)
    assert recs[2]["identical"] is False and recs[2]["difference"]["position"] == 1
    assert recs[3]["context_differs"] is True and recs[3]["identical"] is None and recs[3]["difference"] is None


def stub_setup(names, seen):
    """A Setup of methods that record (method, question id, turn, seed) and answer two tokens."""
    from types import SimpleNamespace

    from specframe.bench import Method, Output

    def method(name):
        def run(ids, max_new, seed):
            seen.append((name, len(ids), seed))
            return Output([5, 6], 1, 0.01, None)

        return Method(name, "specframe", "", run)

    encoder = SimpleNamespace(  # (no chat template: a conversation is its texts one a line, a token each here)
        encode=lambda text, **kw: torch.ones(len(text.split("\n")) + 1, dtype=torch.long),
        tokenizer=SimpleNamespace(chat_template=None),
    )
    tokenizer = SimpleNamespace(decode=lambda ids, **kw: "answer")
    return SimpleNamespace(methods=[method(n) for n in names], encoder=encoder, tokenizer=tokenizer)


def test_each_question_and_turn_gets_its_own_seed_the_same_for_every_method():
    # (documented: seed + 10 * question_id + turn; a seed per question only, or per turn only, passed every test)
    from specframe.bench import BenchOptions, Question, timed_loop

    seen = []
    questions = [Question(3, "qa", "qa", ["a", "b"]), Question(7, "qa", "qa", ["c", "d"])]
    options = BenchOptions(proposers=[], baselines=[], seed=100, progress=False)
    timed_loop(stub_setup(["x", "y"], seen), questions, options, lambda line: None, tqdm)
    seeds = {(name, seed) for name, _, seed in seen[2:]}  # (after the two warm-up runs)
    assert seeds == {(name, 100 + 10 * q + turn) for name in ("x", "y") for q in (3, 7) for turn in (0, 1)}


def test_a_time_limit_starts_no_question_expected_to_end_after_it(monkeypatch):
    # (checked only before each question, the limit let the last question overrun it by all of its methods'
    # turns: a GPU check's bench was stopped from outside, with no report)
    from specframe.bench import BenchOptions, Question, timed_loop

    now = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    setup = stub_setup(["x"], [])
    run = setup.methods[0].run
    setup.methods[0] = dataclasses.replace(
        setup.methods[0], run=lambda *a: (now.__setitem__(0, now[0] + 5), run(*a))[1]
    )
    # one-turn questions of 5 s each, then one of two turns (10 s): at 10 s it would end at 20 s
    questions = [Question(i, s, s, t) for i, (s, t) in enumerate([("qa", ["t"]), ("rag", ["t"]), ("qa", ["a", "b"])])]
    lines = []
    _, _, ran = timed_loop(setup, questions, BenchOptions(proposers=[], baselines=[], time_limit_s=16,
                                                          progress=False), lines.append, tqdm)  # fmt: skip
    assert [q.question_id for q in ran] == [0, 1]
    assert any("stopped after 2 of 3 questions (10 s timed; the next would end at about 20 s)" in m for m in lines)
    now[0] = 0.0
    _, _, ran = timed_loop(setup, questions, BenchOptions(proposers=[], baselines=[], time_limit_s=20,
                                                          progress=False), lines.append, tqdm)  # fmt: skip
    assert len(ran) == 3  # (expected to end at the limit: it runs)


def test_a_time_limit_runs_the_subtasks_in_turn(monkeypatch):
    # (so that a run cut short still covers every subtask; running them in file order passed every test)
    from specframe.bench import BenchOptions, Question, timed_loop

    clock = iter(range(0, 1000))  # (each reading one second later)
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    questions = [Question(i, s, s, ["t"]) for i, s in enumerate(["qa", "qa", "qa", "rag", "rag", "rag"])]
    options = BenchOptions(proposers=[], baselines=[], time_limit_s=4, progress=False)
    _, _, ran = timed_loop(stub_setup(["x"], []), questions, options, lambda line: None, tqdm)
    assert 2 <= len(ran) < len(questions)
    assert [q.subtask for q in ran[:2]] == ["qa", "rag"]


def test_the_longest_conversation_counts_each_earlier_answer_in_the_chat_template():
    from types import SimpleNamespace

    from specframe.bench import Question, longest_conversation

    def encode(messages, **kw):  # (3 template tokens a message, 2 for the generation prompt, a token a word)
        if any("too long" in m["content"] for m in messages):
            raise BadInputError("the prompt is longer than the context window")
        return torch.ones(sum(len(m["content"].split()) + 3 for m in messages) + 2, dtype=torch.long)

    encoder = SimpleNamespace(encode=encode, tokenizer=SimpleNamespace(chat_template="{{ messages }}"))
    one = Question(1, "qa", "qa", ["a b c"])
    two = Question(2, "mt", "mt", ["a b", "c d e f"])
    assert longest_conversation(encoder, [one], 10) == (3 + 3) + 2 + 10
    # user 2 + 3, an empty answer's 3, user 4 + 3, the prompt's 2: 17; then two answers of 10
    assert longest_conversation(encoder, [one, two], 10) == 17 + 2 * 10
    assert longest_conversation(encoder, [one, Question(3, "qa", "qa", ["too long"])], 10) == 18


def test_graph_buffers_are_reserved_within_the_window_and_a_failure_is_only_noted():
    from types import SimpleNamespace

    from specframe.bench import Question, reserve_graph_buffers

    asked = []

    def method(name, window, fails=False):
        def new_cache(length):
            asked.append((name, length))
            if fails:
                raise RuntimeError("CUDA out of memory")

        graphs = SimpleNamespace(new_cache=new_cache)
        return bench.Method(name, "specframe", "", None, SimpleNamespace(graphs=graphs, context_window=window))

    encoder = SimpleNamespace(  # (no chat template: a conversation is its texts one a line, a token a word)
        encode=lambda text, **kw: torch.ones(len(text.split()), dtype=torch.long),
        tokenizer=SimpleNamespace(chat_template=None),
    )
    eager = bench.Method("hf", "transformers", "", None)
    methods = [method("a", 4096), method("b", 300), method("c", 4096, fails=True), eager]
    lines = []
    reserve_graph_buffers(methods, encoder, [Question(1, "qa", "qa", [" ".join(["w"] * 100)])], 256, lines.append)
    assert asked == [("a", 356), ("b", 300), ("c", 356)]
    assert lines == ["note: c's CUDA-graph buffers are made as it runs: RuntimeError: CUDA out of memory"]


def test_a_run_begun_on_a_busy_cpu_says_so_and_what_to_read():
    from specframe.bench import busy_note

    def doc(load, device="cpu"):
        return {"loadavg_start": [load, 0.0, 0.0], "machine": {"nproc": 2}, "settings": {"device": device}}

    assert busy_note(doc(0.9)) == [] and busy_note(doc(3.0, "cuda:0")) == []
    (note,) = busy_note(doc(1.0))
    assert note.startswith("- **the machine was busy**: 1-minute load 1.00 on 2 CPUs before the run started")
    assert "confirm a surprising ratio on an idle machine" in note
