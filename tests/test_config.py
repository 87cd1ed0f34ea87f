import pytest

from specframe import load_config
from specframe.config import GenerationConfig, SamplingConfig, TargetConfig, packaged_configs, to_yaml
from specframe.errors import BadInputError, ConfigError
from specframe.proposers.draft import DraftConfig
from specframe.proposers.eagle import EagleConfig
from specframe.proposers.medusa import MedusaConfig
from specframe.training.draft import DraftTrainConfig
from specframe.training.eagle import EagleTrainConfig


def test_defaults():
    cfg = load_config()
    assert cfg.proposer_name == "none" and cfg.target.model == "smollm2-135m-instruct"
    assert cfg.sampling.temperature == 0.0 and cfg.generation.max_new_tokens == 128


def test_yaml_then_overrides_with_the_proposer_schema(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("proposer:\n  name: draft\n  model: /m\n  num_speculative_tokens: 5\nsampling:\n  top_k: 3\n")
    cfg = load_config(f, ["proposer.num_speculative_tokens=2", "sampling.temperature=0.7", "generation.stop=[END]"])
    assert isinstance(cfg.proposer, DraftConfig)
    assert cfg.proposer.num_speculative_tokens == 2 and cfg.proposer.model == "/m"
    assert cfg.sampling.top_k == 3 and cfg.sampling.temperature == 0.7 and cfg.generation.stop == ["END"]
    assert "num_speculative_tokens: 2" in to_yaml(cfg)


def test_one_stop_string_needs_no_brackets(tmp_path):
    # text alone is one stop string (as the Python API's `stop=`), commas and spaces included, digits too
    assert load_config(None, ["generation.stop=END"]).generation.stop == ["END"]
    assert load_config(None, ["generation.stop=5"]).generation.stop == ["5"]
    assert load_config(None, ["generation.stop='a, b'"]).generation.stop == ["a, b"]
    f = tmp_path / "c.yaml"
    f.write_text("generation:\n  stop: '###'\n")
    assert load_config(f).generation.stop == ["###"]


@pytest.mark.parametrize(
    "typed", ["No", "off", "yes", "TRUE", "Off", "1.50", "0x10", "01", "1e3", "1_000", "+5", ".5", ".inf", "-.NaN"]
)
def test_text_stays_as_typed_where_yaml_would_read_a_value(typed, tmp_path):
    # A stop string or a model path gets exactly the text typed, never YAML's False, 1.5, 16 or 1000.0 written
    # back as text; in a list, alone, and in a config file alike.
    assert load_config(None, [f"generation.stop=[{typed}, x]"]).generation.stop == [typed, "x"]
    assert load_config(None, [f"generation.stop={typed}"]).generation.stop == [typed]
    assert load_config(None, [f"target.model={typed}"]).target.model == typed
    f = tmp_path / "c.yaml"
    f.write_text(f"target:\n  model: {typed}\ngeneration:\n  stop: [{typed}]\n")
    assert (load_config(f).target.model, load_config(f).generation.stop) == (typed, [typed])


def test_typed_fields_still_read_their_values_from_text():
    cfg = load_config(None, ["sampling.temperature=1e-1", "generation.max_new_tokens=1_000", "sampling.top_p=.5"])
    assert (cfg.sampling.temperature, cfg.generation.max_new_tokens, cfg.sampling.top_p) == (0.1, 1000, 0.5)
    assert [
        load_config(None, ["proposer.name=eagle", f"proposer.tree={v}"]).proposer.tree for v in "no Yes off 1".split()
    ] == [
        False,
        True,
        False,
        True,
    ]
    for number in ("2", "-1", "0.5"):  # (OmegaConf would read any of them as true)
        with pytest.raises(ConfigError, match=f"^proposer.tree must be true or false, got {number}$"):
            load_config(None, ["proposer.name=eagle", f"proposer.tree={number}"])
    # true, True, false and False are booleans: quote them for text; other spellings stay text as typed (`TRUE`
    # was the stop string 'True'), and a bool field reads them
    assert load_config(None, ["generation.stop=[true, 'false']"]).generation.stop == ["True", "false"]
    assert load_config(None, ["generation.stop=[TRUE, tRUE]"]).generation.stop == ["TRUE", "tRUE"]
    assert load_config(None, ["proposer.name=eagle", "proposer.tree=FALSE"]).proposer.tree is False
    with pytest.raises(ConfigError, match=r"^sampling.temperature must be a finite number >= 0.*got inf$"):
        load_config(None, ["sampling.temperature=.inf"])
    with pytest.raises(ConfigError, match=r"^generation.max_new_tokens: Value '0x10' of type 'str' could not be"):
        load_config(None, ["generation.max_new_tokens=0x10"])


def test_packaged_configs_load_by_name(tmp_path, monkeypatch):
    assert {"none.yaml", "draft.yaml"} <= set(packaged_configs())
    monkeypatch.chdir(tmp_path)  # (away from the repository's own configs/)
    assert load_config("none.yaml").proposer_name == "none"
    # (DESIGN's `load_config("configs/medusa.yaml")`, from any folder: before, only from the repository's root)
    assert load_config("configs/draft.yaml", ["proposer.model=x"]).proposer.model == "x"
    assert load_config("eagle").proposer_name == "eagle"  # (a packaged config's name without .yaml, as Hydra's)
    for elsewhere in ("typo/eagle", "typo/eagle.yaml", "configs/nothing.yaml", "x/configs/eagle.yaml"):
        with pytest.raises(ConfigError, match=f"config file '{elsewhere}' does not exist"):
            load_config(elsewhere)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["proposer.name=draft", "proposer.nope=1"], "proposer.nope"),
        (["target.modle=x"], "target.modle"),
        (["bogus=1"], "unknown config key 'bogus'"),
        (["sampling.top_k=abc"], "sampling.top_k"),
        (["sampling.temperature=-1"], "sampling.temperature"),
        (["sampling.top_p=0"], "sampling.top_p"),
        (["sampling.top_k=-2"], "sampling.top_k"),
        (["generation.max_new_tokens=0"], "generation.max_new_tokens"),
        (["generation.stop=['ok','']"], "generation.stop must hold non-empty strings"),
        (["proposer.name=draft", "proposer.num_speculative_tokens=0"], "proposer.num_speculative_tokens"),
        (["proposer.name=draft", "proposer.greedy=maybe"], "proposer.greedy"),
        (["sampling.seed=99999999999999999999999"], r"sampling.seed must be an integer in \[-2\*\*63, 2\*\*64\)"),
        (["sampling.seed=-9223372036854775809"], "sampling.seed must be an integer"),
        (
            ["proposer.name=union", "proposer.members=eagle"],
            r"^proposer.members must be a list, e.g. proposer.members=\[eagle\], got 'eagle'$",
        ),
        (["generation.stop={a: 1}"], r"^generation.stop must be a list, got \{'a': 1\} \(set a list field whole"),
        (["generation.stop=${oops}"], r"^generation.stop: Interpolation key 'oops' not found"),
        # Stop strings YAML would read as something else: a mapping, a comment (before: "must be a list, got
        # {'User': None}", "field 'stop' is not Optional")
        (
            ["generation.stop=User:"],
            r"""^generation.stop: User: reads as a YAML mapping; quote .* 'generation.stop="User:"'""",
        ),
        (["generation.stop=[User:]"], r"not valid YAML .*; quote text that holds ':' or '#'"),
        (["generation.stop=#"], r"^override 'generation.stop=#': the value is a YAML comment; quote text that starts"),
        (["generation.stop=a #b"], r"' #' starts a YAML comment, dropping the rest; quote the text"),  # (was ['a'])
        (["generation.stop=- a"], r"'- ' starts a YAML list item"),  # (was ['a'])
        (["generation.stop=[&a]"], r"'&a' is a YAML anchor, a label that YAML drops, not text; .* \(\"&a\", the"),
        (["generation.stop=&x  "], r"'&x' is a YAML anchor"),
        (["generation.stop=User: hi"], r"""for the text 'User: hi', quote it: generation.stop='"User: hi"'\)$"""),
        (["generation.stop.0=x"], r"\(set a list field whole, e.g. generation.stop=\[a,b\]\)$"),
        (
            ["proposer.name=medusa", "proposer.tree=0"],
            r"^proposer.tree must be a list, e.g. proposer.tree=\[\[0\],\[1\],\[0,0\]\], got 0$",
        ),
        (  # (before: "proposer: Invalid value assigned: int is not a ListConfig...", the hint's own example)
            ["proposer.name=medusa", "proposer.tree=[[0],1]"],
            r"^proposer.tree\[1\] must be a list too \(proposer.tree is a list of lists, e.g. "
            r"proposer.tree=\[\[0\],\[1\],\[0,0\]\]\), got 1$",
        ),
        # Interpolations that cannot be resolved, of a value and of a whole section: named, never doubled.
        (["target.model=${oops}"], r"^target.model: Interpolation key 'oops' not found"),
        (["sampling=${oops}"], r"^sampling: Interpolation key 'oops' not found"),
        (["proposer=${oops}"], r"^proposer: Interpolation key 'oops' not found"),
        # (before: accepted here, refused when the model loaded, by a message without the key)
        (["target.dtype=float64"], r"^target.dtype must be one of auto, float32, bfloat16 or float16, got 'float64'$"),
        (
            ["target.dtype=torch.float16"],
            r"^target.dtype must be one of .*, got 'torch.float16'$",
        ),  # (the text; a torch.dtype itself is read)
        (["target.device=gpu"], r"^target.device must be auto, cpu, cuda or cuda:N, got 'gpu'$"),
        (["target.device=cuda:x"], r"^target.device must be auto, cpu, cuda or cuda:N, got 'cuda:x'$"),
    ],
)
def test_bad_config_names_the_full_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_stop_strings_quoted_or_none():
    assert load_config(overrides=['generation.stop="User:"']).generation.stop == ["User:"]
    assert load_config(overrides=['generation.stop="# end"']).generation.stop == ["# end"]
    assert load_config(overrides=['generation.stop=[a, "b #c"]', "target.model=a#b"]).generation.stop == ["a", "b #c"]
    assert load_config(overrides=["generation.stop="]).generation.stop == []  # (`KEY=`: none, as "" for text)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ("sampling.temperature=0.7", "overrides must be a list of 'KEY=VALUE' strings, got a str"),
        ({"sampling.temperature": 0.7}, "overrides must be a list of 'KEY=VALUE' strings, got a dict"),
        (["sampling.temperature"], "override 'sampling.temperature' is not a 'KEY=VALUE' string"),
        ([("sampling.temperature", 0.7)], r"override \('sampling.temperature', 0.7\) is not a 'KEY=VALUE' string"),
    ],
)
def test_overrides_that_are_not_a_list_of_key_values_are_named(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_an_unresolvable_section_in_a_file_is_named(tmp_path):
    (tmp_path / "c.yaml").write_text("sampling: ${oops}\n")
    with pytest.raises(ConfigError, match="^sampling: Interpolation key 'oops' not found"):
        load_config(tmp_path / "c.yaml")


def test_missing_required_value_names_the_key(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("proposer:\n  name: draft\n  model: ???\n")
    with pytest.raises(ConfigError, match="proposer.model: missing mandatory value"):
        load_config(f)


def test_shipped_config_files_load():
    for name in ("none", "draft", "medusa", "eagle"):
        assert load_config(f"{name}.yaml").proposer_name == name


def test_missing_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("/no/such.yaml")
    # Only a bare name is a packaged config: a path in a folder that does not exist is not its file name's
    # packaged config (that loaded eagle.yaml for `typo/eagle.yaml`, without a word).
    with pytest.raises(ConfigError, match="config file 'typo/eagle.yaml' does not exist"):
        load_config("typo/eagle.yaml")


@pytest.mark.parametrize("text", ["target: [unclosed\n", "target:\n\tmodel: x\n"])
def test_a_config_file_that_is_not_yaml_is_a_config_error(tmp_path, text):
    (tmp_path / "bad.yaml").write_text(text)
    with pytest.raises(ConfigError, match="bad.yaml' is not valid YAML"):
        load_config(tmp_path / "bad.yaml")


def test_key_with_nothing_after_the_equals_sign_sets_a_text_option_to_the_empty_string():
    # (a shell turns features_cache="" into features_cache=, which OmegaConf reads as null)
    from omegaconf import OmegaConf

    from specframe.config import structured
    from specframe.training.draft import DraftTrainConfig

    assert structured(DraftTrainConfig, OmegaConf.from_dotlist(["features_cache="]), "train").features_cache == ""


@pytest.mark.parametrize("proposer", ["draft", "medusa", "eagle"])
def test_the_packaged_training_configs_are_valid_for_their_trainer(proposer):
    from specframe.config import load_yaml, recipe_for, structured
    from specframe.plugins import get_registry

    recipe = recipe_for(proposer, load_yaml(f"train-{proposer}.yaml"))
    config = structured(get_registry().get(proposer).cls.train_config_class, recipe, "train")
    assert config.data == "runs/distill/smollm2-135m-instruct.jsonl" and config.out == f"runs/{proposer}"
    other = "eagle" if proposer != "eagle" else "draft"
    with pytest.raises(ConfigError, match=f"for proposer '{proposer}' \\(their `proposer` key\\), not '{other}'"):
        recipe_for(other, load_yaml(f"train-{proposer}.yaml"))
    with pytest.raises(ConfigError, match="hold a `proposer` mapping, as a `specframe generate` config does"):
        recipe_for(proposer, load_yaml(f"{proposer}.yaml"))  # (the generate config of the same name)


def test_a_model_is_user_set_only_when_it_is_not_the_class_default():
    from dataclasses import dataclass

    from specframe.config import user_set

    @dataclass
    class WithDefault:
        model: str | None = "acme/base"

    assert not user_set(WithDefault(), "model") and user_set(WithDefault("mine"), "model")
    assert not user_set(WithDefault(None), "model") and not user_set(WithDefault(""), "model")
    assert user_set(DraftConfig(model="x"), "model") and not user_set(DraftConfig(), "model")


def test_the_packaged_bench_config_is_valid():
    from specframe.bench import BenchOptions
    from specframe.config import load_yaml, structured

    options = structured(BenchOptions, load_yaml("bench-cpu.yaml"), "bench")
    options.validate()
    assert options.limit == 5 and options.threads == 2 and "union" in options.proposers


def test_another_proposer_over_a_config_file_drops_only_the_file_s_proposer_options():
    cfg = load_config(
        "eagle.yaml", ["proposer.name=draft", "proposer.num_speculative_tokens=2", "target.dtype=float32"]
    )
    assert cfg.proposer_name == "draft" and cfg.proposer.num_speculative_tokens == 2
    assert cfg.target.model == load_config("eagle.yaml").target.model and cfg.target.dtype == "float32"
    assert load_config("eagle.yaml", ["proposer.name=eagle", "proposer.tree=false"]).proposer.tree is False


def test_a_config_file_whose_proposer_section_names_none_keeps_its_options(tmp_path):
    (tmp_path / "c.yaml").write_text("proposer:\n  num_speculative_tokens: 7\n")
    assert load_config(tmp_path / "c.yaml", ["proposer.name=draft"]).proposer.num_speculative_tokens == 7


@pytest.mark.parametrize(
    "build, message",
    [
        (
            lambda: TargetConfig(trust_remote_code="false"),
            "target.trust_remote_code must be true or false, got 'false'",
        ),
        (lambda: SamplingConfig(temperature="0.5"), "sampling.temperature must be a number, got '0.5'"),
        (lambda: SamplingConfig(top_p=True), "sampling.top_p must be a number, got True"),
        (lambda: GenerationConfig(max_new_tokens="3"), "generation.max_new_tokens must be an integer, got '3'"),
        (lambda: DraftConfig(greedy="yes"), "proposer.greedy must be true or false, got 'yes'"),
        (lambda: MedusaConfig(tree=[[True]]), r"proposer.tree: each choice must be a non-empty list of ranks"),
        (lambda: MedusaConfig(tree_nodes="5"), "proposer.tree_nodes must be an integer or unset, got '5'"),
        (lambda: EagleConfig(depth=2.0), "proposer.depth must be an integer or unset, got 2.0"),
        (lambda: EagleConfig(total_tokens=1025), r"proposer.total_tokens must be an integer in \[1, 1024\], got 1025"),
        (lambda: MedusaConfig(tree_nodes=1025), r"proposer.tree_nodes must be in \[1, 1024\], got 1025"),
        (lambda: DraftTrainConfig(epochs="3"), "train.epochs must be an integer, got '3'"),
        (lambda: EagleTrainConfig(prompt_positions=1), "train.prompt_positions must be true or false, got 1"),
    ],
)
def test_configs_built_in_python_have_their_fields_types_checked(build, message):
    # OmegaConf types a config read from YAML or overrides; one built in Python gets the same check (a string
    # for a flag was truthy: trust_remote_code="false" turned remote code on).
    with pytest.raises(ConfigError, match=f"^{message}"):
        build()


def test_field_type_checks_take_numbers_flags_and_text_of_other_kinds(tmp_path):
    import torch

    np = pytest.importorskip("numpy")
    assert SamplingConfig(temperature=np.float32(0.5), top_p=1).temperature == 0.5
    assert float(SamplingConfig(temperature=torch.tensor(0.5)).temperature) == 0.5
    assert SamplingConfig(temperature=1.0, top_k=-1).top_k == 0  # vLLM's spelling of top-k off
    with pytest.raises(ConfigError, match=r"^sampling.top_k must be an integer >= 1, or 0 or -1 for off, got -2"):
        SamplingConfig(temperature=1.0, top_k=-2)
    assert DraftTrainConfig(out=tmp_path / "d", lr=1, features_cache=None).lr == 1
    assert MedusaConfig(tree_nodes=np.int64(4)).tree_nodes == 4
    target = TargetConfig(device=torch.device("cpu"), dtype=torch.float32, trust_remote_code=np.False_)
    assert not target.trust_remote_code


def test_interpolations_cross_sections_and_reach_defaults(tmp_path):
    # Each section was validated on its own, so `${generation.max_new_tokens}` in sampling was "not found".
    cfg = load_config(None, ["generation.max_new_tokens=5", "sampling.top_k=${generation.max_new_tokens}"])
    assert cfg.sampling.top_k == 5
    path = tmp_path / "c.yaml"
    path.write_text("target: {model: /models/t}\nproposer: {name: draft, model: '${target.model}'}\n")
    assert load_config(path).proposer.model == "/models/t"
    assert load_config(None, ["proposer.name=draft", "proposer.model=${target.model}"]).proposer.model == (
        TargetConfig().model  # (a default, not given anywhere)
    )
    with pytest.raises(ConfigError, match="^sampling.top_k: Interpolation key 'nope' not found"):
        load_config(None, ["sampling.top_k=${nope}"])
    # An escaped "${" is text, through the resolution above and each section's validation after it.
    path.write_text("target: {model: 'm\\${x}'}\nproposer: {name: draft, model: '${target.model}/d'}\n")
    cfg = load_config(path)
    assert (cfg.target.model, cfg.proposer.model) == ("m${x}", "m${x}/d")
    # A proposer's own defaults, relative keys included; a given `???` stays missing (not a default).
    assert load_config(None, ["proposer.name=draft", "proposer.model=${.dtype}"]).proposer.model == "auto"
    assert load_config(None, ["proposer.name=draft", "target.model=${proposer.dtype}"]).target.model == "auto"
    path.write_text("target: {model: x}\nsampling: {seed: '???'}\n")
    with pytest.raises(ConfigError, match=r"^sampling.seed: missing mandatory value"):
        load_config(path)
    with pytest.raises(ConfigError, match="^unknown config key 'foo'"):  # (before its interpolation is tried)
        load_config(None, ["foo=${bar}"])


def test_the_python_api_says_what_it_takes(tiny_dirs):
    from specframe import SpeculativeDecoder
    from specframe.config import SpecframeConfig, TargetConfig
    from specframe.proposers.draft import DraftConfig

    with pytest.raises(BadInputError, match="from_config takes a SpecframeConfig, got a dict: make one with"):
        SpeculativeDecoder.from_config({"proposer": {"name": "none"}})
    # A hand-built SpecframeConfig: no proposer options are the proposer's defaults; another's are refused by name
    # (before: "proposer 'draft' (plugin 'builtin') failed to build: 'NoneType' object has no attribute 'model'").
    target = TargetConfig(model=str(tiny_dirs["target"]), device="cpu")
    decoder = SpeculativeDecoder.from_config(SpecframeConfig(target=target, proposer_name="none"))
    assert decoder.generate([1, 2], max_new_tokens=3).stats["new_tokens"] == 3
    wrong = SpecframeConfig(target=TargetConfig(model="/nonexistent"), proposer_name="none", proposer=DraftConfig())
    with pytest.raises(ConfigError, match="SpecframeConfig.proposer must be proposer 'none''s .*got a DraftConfig"):
        SpeculativeDecoder.from_config(wrong)
    with pytest.raises(ConfigError, match="load_config takes a YAML file's path .* got a dict for the path"):
        load_config({"a": 1})


def test_a_flag_and_an_override_of_text_that_is_no_number_differ():
    # (`--temperature 0.5` with `sampling.temperature=abc`: the override was taken as the same value and dropped)
    from specframe.config import flag_overrides

    with pytest.raises(BadInputError, match="--temperature 0.5 and the override sampling.temperature=abc set"):
        flag_overrides({"sampling.temperature": ("--temperature", 0.5)}, ["sampling.temperature=abc"])


def test_brief_puts_an_exception_on_one_line():
    from specframe.errors import brief

    e = ValueError("first  line\n\n  second\nthird")
    assert brief(e) == "first line second third" and brief(e, lines=1) == "first line"
    assert brief(e, 12, lines=2) == "first lin..."
    assert brief(RuntimeError("boom"), typed=True) == "RuntimeError: boom"
    assert brief(RuntimeError(""), typed=True) == brief(RuntimeError()) == "RuntimeError"


def test_target_dtype_and_device_names_are_checked_when_the_config_loads():
    # Every spelling the loader reads passes (whether CUDA is there is known only when the model loads).
    for dtype in ("auto", "float32", "FP32", "bfloat16", "bf16", "float16", " fp16 "):
        assert load_config(overrides=[f"target.dtype='{dtype}'"]).target.dtype == dtype
    for device in ("auto", "cpu", "CUDA", "cuda:1"):
        assert load_config(overrides=[f"target.device={device}"]).target.device == device
