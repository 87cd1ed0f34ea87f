import io
import json
import os
import subprocess
import sys

import pytest

from specframe.cli import main


def run(capsys, *argv, stdin=None, monkeypatch=None):
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def gen_args(tiny_dirs, *extra):
    return ["generate", "--target", str(tiny_dirs["target"]), "--max-new-tokens", "6", *extra]


def test_generate_json_with_a_draft(capsys, tiny_dirs):
    code, out, err = run(
        capsys,
        *gen_args(
            tiny_dirs,
            "--proposer",
            "draft",
            "--json",
            f"proposer.model={tiny_dirs['draft']}",
            "proposer.num_speculative_tokens=3",
            "--prompt",
            "a b c",
            "--raw",
        ),
    )
    assert code == 0, err
    res = json.loads(out)
    assert set(res) == {"text", "token_ids", "stats", "shapes"} and res["shapes"] == []  # (γ configured)
    # The target's own greedy continuation (up to its EOS), and stats that agree with it.
    from specframe.models import load_model
    from specframe.testing.conformance import reference_greedy

    target = load_model(str(tiny_dirs["target"]), quiet=True)
    greedy = reference_greedy(target.model, target.tokenizer("a b c")["input_ids"], 6)
    eos = target.tokenizer.eos_token_id
    assert 1 <= len(res["token_ids"]) and res["token_ids"] == greedy[: greedy.index(eos) + 1 if eos in greedy else 6]
    s = res["stats"]
    assert s["new_tokens"] == len(res["token_ids"]) and s["target_forwards"] >= 1
    assert s["mean_accepted_length"] == pytest.approx(s["new_tokens"] / s["target_forwards"])
    assert res["text"] == target.tokenizer.decode(res["token_ids"], skip_special_tokens=True)
    assert {
        "new_tokens",
        "target_forwards",
        "mean_accepted_length",
        "proposed_tokens",
        "accepted_tokens",
        "acceptance_rate",
        "wall_time_s",
        "tokens_per_s",
    } <= set(res["stats"])


def test_generate_plain_text_and_stdin_prompt(capsys, tiny_dirs, monkeypatch):
    code, out, err = run(capsys, *gen_args(tiny_dirs, "--proposer", "none"), stdin="a b", monkeypatch=monkeypatch)
    assert code == 0 and out.strip() != "" and "mean accepted length 1.00" in err
    # Standard output is the answer's text once (streamed in pieces) and a line end, as --json gives the text.
    code, as_json, _ = run(capsys, *gen_args(tiny_dirs, "--proposer", "none", "--json", "--prompt", "a b"))
    assert code == 0 and out == json.loads(as_json)["text"] + "\n"
    # (the tiny tokenizer has no chat template: the prompt goes in as it is, and generate says so, as bench does)
    assert "note: the target's tokenizer has no chat template: the prompt is given as it is" in err
    # The line end that `echo` adds is not part of the prompt (as with --prompt "a b").
    from specframe.decoder import SpeculativeDecoder

    prompts, generate = [], SpeculativeDecoder.generate
    spy = lambda self, p, **kw: prompts.append(p) or generate(self, p, **kw)  # noqa: E731
    monkeypatch.setattr(SpeculativeDecoder, "generate", spy)
    code, _, err = run(capsys, *gen_args(tiny_dirs, "--proposer", "none"), stdin="a b\n", monkeypatch=monkeypatch)
    assert code == 0 and prompts == ["a b"] and "reading the prompt" not in err  # (a pipe: no word)

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    monkeypatch.setattr(sys, "stdin", Terminal("a b"))  # at a terminal, it says why it waits
    code, _, err = run(capsys, *gen_args(tiny_dirs, "--proposer", "none"))
    assert code == 0 and "specframe: reading the prompt from standard input (end it with Ctrl-D" in err


def test_the_cli_s_default_target_is_the_models_default_alias():
    from specframe.cli import DEFAULT_TARGET
    from specframe.models import DEFAULT_ALIAS

    assert DEFAULT_TARGET == DEFAULT_ALIAS


def test_sampling_options_at_temperature_0_are_said_to_do_nothing(capsys, tiny_dirs):
    # (before: `--top-p 0.5` without --temperature decoded greedily without a word)
    prompt = ("--prompt", "a b", "--raw")
    code, out, err = run(capsys, *gen_args(tiny_dirs, "--proposer", "none", *prompt, "--top-p", "0.5", "--seed", "3"))
    assert code == 0 and out.strip(), err
    assert "note: sampling.top_p and sampling.seed have no effect at temperature 0 (greedy decoding)" in err, err
    code, _, err = run(capsys, *gen_args(tiny_dirs, "--proposer", "none", *prompt, "--top-k", "-1"))  # (off: no note)
    assert code == 0 and "note:" not in err, err
    code, _, err = run(
        capsys, *gen_args(tiny_dirs, "--proposer", "none", *prompt, "--temperature", "1", "--top-k", "3")
    )
    assert code == 0 and "note:" not in err, err


def test_min_p_reaches_the_sampler(capsys, tiny_dirs):
    # min_p 1 keeps only the top token: sampling at temperature 2 then gives the greedy tokens (and does not
    # without it), whether the flag or the config key sets it
    outs = {}
    for name, extra in {
        "greedy": [],
        "hot": ["--temperature", "2", "--seed", "1"],
        "flag": ["--temperature", "2", "--seed", "1", "--min-p", "1"],
        "key": ["--temperature", "2", "--seed", "1", "sampling.min_p=1.0"],
    }.items():
        args = gen_args(tiny_dirs, "--proposer", "draft", f"proposer.model={tiny_dirs['draft']}", "--json", *extra)
        code, out, err = run(capsys, *args, "--prompt", "a b c", "--raw")
        assert code == 0 and "note:" not in err, err
        outs[name] = json.loads(out)["token_ids"]
    assert outs["flag"] == outs["key"] == outs["greedy"] != outs["hot"]
    code, _, err = run(capsys, *gen_args(tiny_dirs, "--proposer", "none", "--prompt", "a", "--raw", "--min-p", "0.2"))
    assert code == 0 and "note: sampling.min_p has no effect at temperature 0 (greedy decoding)" in err, err


def test_stop_token_ids_and_ignore_eos_from_the_command_line(capsys, tiny_dirs):
    args = gen_args(tiny_dirs, "--proposer", "none", "--json", "--prompt", "a b c", "--raw")
    code, out, err = run(capsys, *args)
    ids = json.loads(out)["token_ids"]
    assert code == 0 and len(ids) == 6, err
    code, out, err = run(capsys, *args, f"generation.stop_token_ids={ids[2]}", "generation.ignore_eos=true")
    res = json.loads(out)
    cut = ids.index(ids[2])
    assert code == 0 and res["token_ids"] == ids[: cut + 1], err
    assert res["stats"]["finish_reason"] == "stop"
    # the stop token's text is left out, as vLLM leaves it out: the text of the tokens before it
    shorter = json.loads(run(capsys, *gen_args(tiny_dirs, "--proposer", "none", "--json", "--prompt", "a b c", "--raw",
                                               "--max-new-tokens", str(cut)))[1])  # fmt: skip
    assert res["text"] == shorter["text"] and res["text"] != json.loads(run(capsys, *args)[1])["text"]
    code, out, err = run(capsys, *args, "--logprobs")
    res = json.loads(out)
    assert code == 0 and res["token_ids"] == ids and len(res["logprobs"]) == 6, err
    assert all(lp <= 0 for lp in res["logprobs"]) and "logprobs" not in json.loads(run(capsys, *args)[1])
    code, out, err = run(capsys, *args, "--top-logprobs", "2")  # (turns --logprobs on)
    top = json.loads(out)
    assert code == 0 and top["logprobs"] == res["logprobs"] and len(top["top_logprobs"]) == 6, err
    first = top["top_logprobs"][0]
    assert [set(t) for t in first] == [{"token_id", "text", "logprob"}] * 2 and first[0]["logprob"] >= first[1][
        "logprob"
    ]
    assert all(isinstance(t["text"], str) for t in first) and "top_logprobs" not in res
    for bad, message in (
        ("generation.stop_token_ids=[abc]", "generation.stop_token_ids"),
        ("generation.stop_token_ids=[-3]", "generation.stop_token_ids must hold token ids (integers >= 0), got -3"),
        ("generation.stop_token_ids=[100000]", "generation.stop_token_ids holds 100000: not a token id of this target"),
        ("generation.ignore_eos=maybe", "generation.ignore_eos"),
        ("generation.top_logprobs=-2", "generation.top_logprobs must be >= 0, got -2"),
        ("generation.top_logprobs=1000000", "generation.top_logprobs must be at most the target's vocabulary"),
    ):
        code, _, err = run(capsys, *args, bad)
        assert code == 2 and message in err, (bad, err)


def test_greedy_output_identical_across_proposers(capsys, tiny_dirs):
    outs = []
    for extra in (["--proposer", "none"], ["--proposer", "draft", f"proposer.model={tiny_dirs['draft']}"]):
        code, out, err = run(capsys, *gen_args(tiny_dirs, *extra, "--json", "--prompt", "a b c"))
        assert code == 0, err
        outs.append(json.loads(out)["token_ids"])
    assert outs[0] == outs[1]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--proposer", "nope"], "unknown proposer 'nope'; installed: "),
        (["--proposer", "none", "bogus.key=1"], "unknown config key 'bogus'"),
        (["--proposer", "none", "sampling.top_k=abc"], "sampling.top_k"),
        (["--proposer", "none", "--temperature", "-1"], "sampling.temperature"),
        (["--proposer", "none", "--temperature", "inf"], "sampling.temperature"),
        (["--proposer", "none", "--top-p", "1.5"], "sampling.top_p"),
        (["--proposer", "none", "--top-p", "0"], "sampling.top_p"),
        (["--proposer", "none", "--top-k", "-2"], "sampling.top_k"),
        (["--proposer", "none", "--min-p", "1.5"], "sampling.min_p must be a number in [0, 1]"),
        (
            ["--proposer", "none", "--repetition-penalty", "0"],
            "sampling.repetition_penalty must be a finite number > 0",
        ),
        (
            ["--proposer", "none", "sampling.presence_penalty=9"],
            "sampling.presence_penalty must be a number in [-2, 2]",
        ),
        (["--proposer", "none", "sampling.min_p=-0.1"], "sampling.min_p"),
        (["--proposer", "none", "--max-new-tokens", "0"], "generation.max_new_tokens"),
        (["--proposer", "none", "--prompt", ""], "prompt is empty"),
        (["--proposer", "none", "--prompt", "hi \udcff"], "the argument 'hi \\xff' is not UTF-8 text"),
        (["--proposer", "none", "generation.stop=[!]"], "override 'generation.stop=[!]': the value is not valid YAML"),
        (["--proposer", "none", "generation.stop=[?]"], "(the value is read as YAML: quote text that YAML reads"),
        (["--proposer", "none", "notkeyvalue"], "not KEY=VALUE"),
        (["--proposer", "draft"], "proposer.model is required"),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, tiny_dirs, extra, message):
    args = gen_args(tiny_dirs, *extra)
    if "--prompt" not in extra:
        args += ["--prompt", "a b"]
    code, out, err = run(capsys, *args)
    assert code == 2 and message in err and err.count("\n") == 1 and "Traceback" not in err and out == ""


def test_overrides_may_follow_options(capsys, tiny_dirs):
    # (argparse fills a KEY=VALUE positional once: those after a later option were "unrecognized arguments")
    opts = ["--proposer", "none", "--json", "--raw", "--prompt", "a b"]
    sampled = ["sampling.temperature=1.0", "sampling.seed=3"]
    code, before, err = run(capsys, *gen_args(tiny_dirs, *sampled, *opts))
    assert code == 0, err
    code, after, err = run(capsys, *gen_args(tiny_dirs, "sampling.temperature=1.0", *opts, "sampling.seed=3"))
    assert code == 0, err
    assert json.loads(after)["token_ids"] == json.loads(before)["token_ids"]
    code, out, err = run(capsys, *gen_args(tiny_dirs, *opts, "bogus.key=1"))
    assert code == 2 and "unknown config key 'bogus'" in err
    with pytest.raises(SystemExit) as exit_:  # (anything else left over is still argparse's error)
        main(gen_args(tiny_dirs, *opts, "--bogus", "3"))
    err = capsys.readouterr().err  # (one line, naming the subcommand, not the top level)
    assert exit_.value.code == 2 and err.startswith("specframe generate: error: unrecognized arguments: --bogus")
    assert err.count("\n") == 1 and err.endswith("(`specframe generate --help` shows the usage)\n")
    for argv, why in (
        (["models", "list", "--x"], "specframe models list: error: unrecognized arguments: --x"),
        (["train"], "specframe train: error: the following arguments are required: --proposer"),
        (["generate", "--max-new-tokens", "x"], "specframe generate: error: argument --max-new-tokens: invalid int"),
        ([], "specframe: error: the following arguments are required: COMMAND"),
        (["models"], "specframe models: error: the following arguments are required: pull|list"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(why) and err.count("\n") == 1, (argv, err)


@pytest.mark.parametrize(
    "text, message", [("42\n", "must hold a mapping, not int 42"), ("[a]\n", "must hold a mapping, not list")]
)
def test_a_config_file_that_is_not_a_mapping_exits_2(capsys, tiny_dirs, tmp_path, text, message):
    (tmp_path / "c.yaml").write_text(text)
    code, out, err = run(capsys, *gen_args(tiny_dirs, "--prompt", "a b", "--config", str(tmp_path / "c.yaml")))
    assert code == 2 and f"config file '{tmp_path / 'c.yaml'}' {message}" in err
    code, out, err = run(capsys, *gen_args(tiny_dirs, "--prompt", "a b", "--config", str(tmp_path)))
    assert code == 2 and "is a folder, not a YAML file" in err


def test_a_cut_at_the_context_window_is_said(capsys, tiny_dirs):
    # tiny_dirs["short"] has a context window of 8 tokens: a 5-token prompt leaves room for 3 of the 6 asked for.
    args = ["generate", "--target", str(tiny_dirs["short"]), "--proposer", "none", "--raw", "--prompt", "a b c d e"]
    code, out, err = run(capsys, *args, "--max-new-tokens", "6", "--json")
    stats = json.loads(out)["stats"]
    assert code == 0 and stats["new_tokens"] == 3 and stats["finish_reason"] == "context"
    assert "specframe: stopped after 3 of generation.max_new_tokens=6 tokens: the target's context window (8" in err


def test_prompt_longer_than_context(capsys, tiny_dirs):
    code, _, err = run(
        capsys,
        "generate",
        "--target",
        str(tiny_dirs["short"]),
        "--proposer",
        "none",
        "--raw",
        "--prompt",
        " ".join(["a"] * 20),
    )
    assert code == 2 and "context window is 8" in err


def test_vocabulary_mismatch(capsys, tiny_dirs):
    code, _, err = run(
        capsys, *gen_args(tiny_dirs, "--proposer", "draft", f"proposer.model={tiny_dirs['wide']}", "--prompt", "a")
    )
    assert code == 2 and "vocabulary mismatch" in err


def test_missing_model_path(capsys, tmp_path):
    code, _, err = run(capsys, "generate", "--target", str(tmp_path / "nowhere"), "--proposer", "none", "--prompt", "a")
    assert code == 2 and "does not exist" in err


def test_a_missing_draft_model_is_named_as_the_draft(capsys, tiny_dirs, tmp_path):
    missing = f"proposer.model={tmp_path / 'nowhere'}"
    code, _, err = run(capsys, *gen_args(tiny_dirs, "--proposer", "draft", missing, "--prompt", "a"))
    assert code == 2 and f"error: proposer.model (the draft model): model path '{tmp_path / 'nowhere'}' does not" in err


def test_debug_shows_traceback(capsys, tiny_dirs):
    code, _, err = run(capsys, "--debug", *gen_args(tiny_dirs, "--proposer", "nope", "--prompt", "a"))
    assert code == 2 and "Traceback" in err


def test_token_id_prompt_without_tokenizer_through_python(tiny_dirs):
    from specframe import SpeculativeDecoder, load_config

    cfg = load_config(
        overrides=[
            f"target.model={tiny_dirs['bare']}",
            "proposer.name=draft",
            f"proposer.model={tiny_dirs['draft']}",
            "generation.max_new_tokens=5",
        ]
    )
    res = SpeculativeDecoder.from_config(cfg).generate([1, 2, 3])
    assert res.text is None and len(res.token_ids) == 5


def test_text_prompt_without_tokenizer_on_the_command_line_is_refused(capsys, tiny_dirs):
    code, _, err = run(capsys, "generate", "--target", str(tiny_dirs["bare"]), "--prompt", "a b")
    assert code == 2 and "has no tokenizer, so a text prompt cannot be encoded" in err and "Python API" in err


def test_plugins_lists_builtins(capsys):
    code, out, _ = run(capsys, "plugins", "--json")
    rows = {r["name"]: r for r in json.loads(out)["proposers"]}
    assert code == 0 and rows["none"]["plugin"] == "builtin" and rows["draft"]["distribution"] == "specframe"
    code, out, _ = run(capsys, "plugins")
    assert code == 0 and "draft" in out and "plugin builtin" in out


def test_check_names_a_proposer_option_that_has_no_default(capsys, monkeypatch):
    from dataclasses import dataclass

    from specframe import plugins
    from specframe.proposers.draft import DraftProposer

    @dataclass
    class NeedsK:
        k: int  # (no default: the user must set it)

    class NeedsKProposer(DraftProposer):
        name = "needs_k"
        config_class = NeedsK

    registry = plugins.build_registry(autoload=False)
    registry.add(NeedsKProposer, "acme", "acme-specframe", "1.0")
    monkeypatch.setattr(plugins, "_registry", registry)
    code, _, err = run(capsys, "check", "--proposer", "needs_k", "--quick")
    assert code == 2 and "proposer.k: missing mandatory value (set it with proposer.k=...)" in err


def test_check_quick(capsys):
    code, out, _ = run(capsys, "check", "--proposer", "draft", "--quick", "--device", "cpu")
    assert code == 0 and "PASS  greedy [cpu]" in out and "PASS  isolation [cpu]" in out and "3 passed, 0 failed" in out
    assert out.count("PASS  greedy [cpu]") == 1 and out.startswith("conformance of proposer 'draft':\n")


def test_check_in_several_dtypes(capsys):
    code, out, _ = run(
        capsys,
        "check",
        "--proposer",
        "eagle",
        "--quick",
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--dtype",
        "bfloat16",
        "--json",
    )
    report = json.loads(out)
    assert code == 0 and report["passed"]
    assert [(r["check"], r["dtype"]) for r in report["results"]] == [
        ("greedy", "float32"),
        ("rollback", "float32"),
        ("isolation", "float32"),
        ("greedy", "bfloat16"),
        ("rollback", "bfloat16"),
        ("isolation", "bfloat16"),
    ]
    for bad in (["--dtype", "float8"], ["--device", "tpu"]):  # (refused before the header)
        code, out, err = run(capsys, "check", "--proposer", "eagle", "--quick", *bad)
        assert code == 2 and bad[1] in err and out == ""


def test_check_on_tiny_targets_of_other_model_types(capsys):
    code, out, _ = run(
        capsys, "check", "--proposer", "medusa", "--quick", "--device", "cpu", "--arch", "qwen2", "--arch", "gpt2"
    )
    assert code == 0 and "PASS  greedy [cpu, qwen2]" in out and "PASS  isolation [cpu, gpt2]" in out, out
    assert "6 passed, 0 failed" in out and "[cpu]" not in out  # (llama only when no --arch is given)
    code, out, _ = run(
        capsys, "check", "--proposer", "none", "--quick", "--device", "cpu", "--arch", "mistral", "--json"
    )
    assert code == 0 and {r["arch"] for r in json.loads(out)["results"]} == {"mistral"}
    code, out, _ = run(
        capsys, "check", "--proposer", "none", "--quick", "--device", "cpu", "--arch", "llama", "--arch", "gpt2"
    )
    assert code == 0 and "PASS  greedy [cpu, llama]" in out and "PASS  greedy [cpu, gpt2]" in out, out
    assert "[cpu]" not in out  # (llama among other types is named as they are)
    code, out, err = run(capsys, "check", "--proposer", "none", "--quick", "--arch", "mistrall")  # (before the header)
    assert code == 2 and out == "" and "knows no model type 'mistrall'" in err, err


def test_python_dash_m_entry_point():
    r = subprocess.run(
        [sys.executable, "-m", "specframe", "generate", "--proposer", "zzz", "--prompt", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "unknown proposer 'zzz'" in r.stderr


def test_a_reader_that_has_gone_ends_the_command_quietly():
    # `specframe plugins --json | true`: was "specframe: error: [Errno 32] Broken pipe", exit 1
    p = subprocess.Popen(
        [sys.executable, "-m", "specframe", "plugins", "--json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    p.stdout.close()  # (before it writes)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141 and err == ""


def test_an_argument_that_is_not_utf8_is_refused_by_name(capsys, tiny_dirs):
    # (undecodable bytes reach Python as surrogates; they failed later, in YAML or a path, exit 1)
    code, _, err = run(capsys, *gen_args(tiny_dirs, "--proposer", "none"), "generation.stop=[\udcff]")
    assert code == 2 and "the argument 'generation.stop=[\\xff]' is not UTF-8 text" in err


def test_standard_input_that_is_not_utf8_is_refused_before_the_model_loads(capsys, tmp_path, monkeypatch):
    # (before: under a locale whose standard input decodes strictly, e.g. en_US.UTF-8, exit 1 with the codec's
    # "can't decode byte 0xff"; the target named here does not exist: the prompt is refused first)
    strict = io.TextIOWrapper(io.BytesIO(b"Say hi \xff there\n"), encoding="utf-8", errors="strict")
    monkeypatch.setattr(sys, "stdin", strict)
    code, _, err = run(capsys, "generate", "--proposer", "none", "--target", str(tmp_path / "absent"))
    assert code == 2 and "the prompt is not valid UTF-8 text (bad byte at character 7)" in err, err


def test_a_prompt_of_white_space_is_text_for_the_tokenizer(capsys, tiny_dirs):
    # (before: refused as empty up front; transformers and vLLM take it, and a raw "\n" is a prompt for a base
    # model. The tiny tokenizer splits on white space: it makes no token of it, and says so)
    code, out, err = run(capsys, *gen_args(tiny_dirs, "--proposer", "none", "--prompt", " \n"))
    assert code == 2 and "the prompt's text gives no tokens" in err, err


def test_check_with_proposer_options_and_bad_option(capsys):
    code, out, _ = run(
        capsys, "check", "--proposer", "draft", "--quick", "--device", "cpu", "proposer.num_speculative_tokens=1"
    )
    assert code == 0 and "3 passed, 0 failed" in out
    code, _, err = run(capsys, "check", "--proposer", "draft", "--quick", "proposer.num_speculative_tokens=0")
    assert code == 2 and "proposer.num_speculative_tokens" in err
    # trained weights cannot be checked on the suite's tiny targets: said, not silently ignored
    code, out, err = run(capsys, "check", "--proposer", "medusa", "--quick", "proposer.model=runs/heads")
    assert code == 2 and out == "" and "proposer.model=runs/heads would not be used" in err
    code, out, err = run(capsys, "check", "--proposer", "union", "--quick", "proposer.options.eagle.model=runs/e")
    assert code == 2 and out == "" and "proposer.options.eagle.model=runs/e would not be used" in err


def test_a_broken_plugin_is_one_warning_line(capsys, monkeypatch):
    from specframe import plugins

    class BadEntryPoint:
        name, dist = "acme-broken", None

        def load(self):
            raise ImportError("no module named acme")

    monkeypatch.setattr(plugins.importlib.metadata, "entry_points", lambda group: [BadEntryPoint()])
    monkeypatch.setattr(plugins, "_registry", None)
    code, out, err = run(capsys, "plugins")
    assert code == 0 and "none" in out
    assert err.count("\n") == 1 and err.startswith("specframe: warning: plugin 'acme-broken'")
    monkeypatch.setattr(plugins, "_registry", None)


@pytest.mark.parametrize(
    "raised, code, line",
    [
        (RuntimeError("disk on fire"), 1, "specframe: error: disk on fire"),  # any other failure: exit 1, one line
        (KeyboardInterrupt(), 130, "specframe: interrupted"),
    ],
)
def test_failures_that_are_not_bad_input_exit_1_and_an_interrupt_130(capsys, monkeypatch, raised, code, line):
    import specframe.models

    def boom(*args, **kwargs):
        raise raised

    monkeypatch.setattr(specframe.models, "list_models", boom)
    code_got, out, err = run(capsys, "models", "list")
    assert (code_got, out, err) == (code, "", line + "\n")


def test_sigterm_unwinds_as_an_interrupt_and_exits_143(capsys, monkeypatch):
    # (a scheduler's or kill's stop: `finally` blocks run, locks and temporary files go, as for Ctrl-C)
    import signal
    import time

    import specframe.models

    unwound = []

    def stopped(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        finally:
            unwound.append(True)

    before = signal.getsignal(signal.SIGTERM)
    monkeypatch.setattr(specframe.models, "list_models", stopped)
    assert run(capsys, "models", "list") == (143, "", "specframe: terminated\n")
    assert unwound == [True] and signal.getsignal(signal.SIGTERM) is before
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # (ignored by the parent, as `nohup`-like wrappers may: kept so)
    try:
        monkeypatch.setattr(specframe.models, "list_models", lambda *a, **k: [])
        assert run(capsys, "models", "list")[0] == 0 and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
        monkeypatch.setattr(specframe.models, "list_models", lambda *a, **k: unwound.append(signal.getsignal(15)))
        run(capsys, "models", "list")
        assert unwound[-1] == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)


def test_generate_flags_are_taken_as_typed_and_may_not_contradict_an_override(capsys, tiny_dirs, tmp_path):
    # --target is a path, not YAML: " #" starts no comment (the folder before it was loaded instead), ": " makes
    # no mapping, "${" no interpolation. Each of these folders is empty, so each must be refused by its name.
    (tmp_path / "m").symlink_to(tiny_dirs["target"], target_is_directory=True)
    for name in ("m #2", "m: v2", "m${x}", "it's"):
        (tmp_path / name).mkdir()
        argv = ["generate", "--target", str(tmp_path / name), "--proposer", "none", "--prompt", "a"]
        code, out, err = run(capsys, *argv)
        assert code == 2 and f"{tmp_path / name} has no config.json" in err and out == "", (name, err)
    # A flag and a KEY=VALUE override of the same key: refused when they differ (which was meant?), fine when not.
    code, out, err = run(capsys, *gen_args(tiny_dirs, "--prompt", "a", "--temperature", "0", "sampling.temperature=1"))
    assert code == 2 and out == ""
    assert "--temperature 0.0 and the override sampling.temperature=1 set sampling.temperature differently" in err
    # ... also when the override sets the flag's whole section (the flag, applied last, would replace it unseen)
    for override, message in [
        ("sampling={temperature: 1.0, seed: 3}", "--temperature 0.0 and the override sampling={temperature: 1.0, "),
        ("sampling=abc", "the override sampling=abc sets sampling to something that is not a mapping"),
        ("proposer={name: eagle}", "--proposer none and the override proposer={name: eagle} set proposer.name"),
    ]:
        flags = ["--temperature", "0", "--proposer", "none"]
        code, out, err = run(capsys, *gen_args(tiny_dirs, "--prompt", "a", *flags, override))
        assert code == 2 and out == "" and message in err, (override, err)
    code, out, err = run(capsys, *gen_args(tiny_dirs, "--prompt", "a", "--temperature", "0", "sampling={seed: 3}"))
    assert code == 0 and out
    # The same value, spelled as the config reads it (text kept as typed, numbers converted): not a contradiction.
    same = [
        "--temperature",
        "0.1",
        "sampling.temperature=1e-1",
        "--max-new-tokens",
        "3",
        "generation.max_new_tokens=03",
    ]
    code, out, err = run(capsys, *gen_args(tiny_dirs, "--prompt", "a", *same))
    assert code == 0 and out, err
    code, out, err = run(capsys, "generate", "--target", "1.10", "target.model=1.10", "--prompt", "a")
    assert code == 2 and "model path '1.10' does not exist" in err, err  # (not "set target.model differently")
    code, out, err = run(capsys, *gen_args(tiny_dirs, "--prompt", "a", "generation.max_new_tokens=6", "--json"))
    assert code == 0 and 1 <= len(json.loads(out)["token_ids"]) <= 6


def test_check_takes_a_generate_config_s_proposer_section(capsys, tmp_path):
    config = tmp_path / "c.yaml"
    config.write_text("proposer:\n  name: draft\n  num_speculative_tokens: 1\n")
    code, out, _ = run(capsys, "check", "--config", str(config), "--quick", "--device", "cpu", "--json")
    assert code == 0 and json.loads(out)["proposer"] == "draft"
    config.write_text("proposer:\n  name: draft\n  num_speculative_tokens: 0\n")  # (its options are checked)
    code, _, err = run(capsys, "check", "--config", str(config), "--quick")
    assert code == 2 and "proposer.num_speculative_tokens" in err
    for args, message in ((["--proposer", "eagle"], "--proposer eagle and --config"), ([], None)):
        code, _, err = run(
            capsys, "check", "--config", str(config), *args, "--quick", "proposer.num_speculative_tokens=1"
        )
        assert (code == 2 and message in err) if message else code == 0, err
    code, _, err = run(capsys, "check", "--quick")
    assert code == 2 and "give --proposer NAME" in err
    config.write_text("gamma: 1\nproposer:\n  name: draft\n  num_speculative_tokens: ${gamma}\n")  # (resolved)
    code, out, _ = run(capsys, "check", "--config", str(config), "--quick", "--device", "cpu", "--json")
    report = json.loads(out)
    assert code == 0 and report["quick"] is True and "trace" not in report["results"][0]
    config.write_text("limit: 3\n")  # (a bench config)
    code, _, err = run(capsys, "check", "--config", str(config), "--proposer", "draft", "--quick")
    assert code == 2 and "has no proposer section" in err
    # A working generate config for one's own target names its trained models: the file's are set aside, said
    # (before: refused, so no such config could be checked); one typed on the command line is still refused.
    config.write_text(
        "proposer:\n  name: union\n  members: [draft, ngram]\n"
        "  options: {draft: {model: runs/draft, num_speculative_tokens: 2}}\n"
    )
    code, out, err = run(capsys, "check", "--config", str(config), "--quick", "--device", "cpu", "--json")
    assert code == 0 and json.loads(out)["passed"], err
    assert "note: proposer.options.draft.model=runs/draft from --config" in err and "not loaded" in err, err
    code, _, err = run(capsys, "check", "--config", str(config), "--quick", "proposer.options.draft.model=x")
    assert code == 2 and "proposer.options.draft.model=x would not be used" in err, err
    config.write_text("proposer:\n  name: draft\n  model: runs/d\n")
    code, out, err = run(capsys, "check", "--config", str(config), "--quick", "--device", "cpu", "--json")
    assert code == 0 and "note: proposer.model=runs/d from --config" in err, err


def test_distill_counts_below_one_are_refused_before_the_model_loads(capsys, tmp_path):
    for option in ("--limit", "--batch-size", "--max-new-tokens", "--max-prompt-tokens"):
        argv = ["data", "distill", "--out", str(tmp_path / "d.jsonl"), "--target", str(tmp_path / "absent"), option]
        code, out, err = run(capsys, *argv, "0")
        assert code == 2 and f"{option} must be >= 1, got 0" in err and "absent" not in err, (option, err)
    assert not (tmp_path / "d.jsonl").exists()


def test_distill_without_the_shared_prompts_says_to_give_prompts(capsys, tmp_path, monkeypatch):
    import specframe.data

    absent = tmp_path / "shared" / "data" / "train_prompts" / "prompts.jsonl"
    monkeypatch.setattr(specframe.data, "shared_data_file", lambda relative: absent)  # (as outside a checkout)
    code, out, err = run(capsys, "data", "distill", "--out", str(tmp_path / "d.jsonl"))
    assert code == 2 and f"the default prompts file '{absent}' does not exist" in err and "give --prompts FILE" in err
    assert not (tmp_path / "d.jsonl").exists()


def test_an_unknown_option_after_overrides_is_refused_not_dropped(capsys, tiny_dirs):
    # (KEY=VALUE items after a later option join the overrides only when nothing else is left over: with an
    # unknown option among them, all were taken and the option silently dropped)
    with pytest.raises(SystemExit) as exit_:
        main(gen_args(tiny_dirs, "--prompt", "hi", "sampling.seed=1", "--raw", "generation.max_new_tokens=2", "--x"))
    assert exit_.value.code == 2 and "unrecognized arguments: generation.max_new_tokens=2 --x" in (
        capsys.readouterr().err
    )


def test_check_options_must_be_proposer_keys(capsys):
    code, out, err = run(capsys, "check", "--proposer", "ngram", "--quick", "max_ngram=2")
    assert code == 2 and "override 'max_ngram=2' is not proposer.KEY=VALUE" in err and out == "", err
