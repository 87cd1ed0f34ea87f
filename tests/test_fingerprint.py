import copy
import json

import pytest
import torch

from specframe.errors import ModelLoadError
from specframe.fingerprint import check_vocab_ids, fingerprint_mismatch, mark_adapter, target_fingerprint
from specframe.testing.tiny import tiny_llama


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_same_weights_match_in_every_dtype(model, dtype):
    saved = target_fingerprint(model)  # as a trainer saves it: from the float32 target
    assert fingerprint_mismatch(saved, copy.deepcopy(model).to(dtype)) is None


def test_other_weights_do_not_match(model):
    saved = target_fingerprint(model)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[1].self_attn.o_proj.weight.view(-1)[0] += 1e-3  # one sampled value, embeddings untouched
    assert fingerprint_mismatch(saved, other) == "the weights differ (compared in float32)"
    wide = tiny_llama(vocab_size=24, seed=0, hidden_size=32, num_layers=2)
    assert fingerprint_mismatch(saved, wide) == "vocab size 16 there, 24 here"


def test_a_change_that_survives_rounding_is_seen_in_half_precision(model):
    saved = target_fingerprint(model)
    other = copy.deepcopy(model)
    with torch.no_grad():
        other.model.layers[0].mlp.down_proj.weight.view(-1)[0] += 0.5
    assert fingerprint_mismatch(saved, other.to(torch.bfloat16)) == "the weights differ (compared in bfloat16)"


def test_an_old_format_or_missing_fingerprint_is_named(model):
    old = {"vocab_size": 16, "hidden_size": 32, "embedding_sha256": "0" * 64}
    assert "older format" in fingerprint_mismatch(old, model)
    assert "missing" in fingerprint_mismatch(None, model)


def adapter_folder(folder, weights: bytes, **config):
    folder.mkdir()
    (folder / "adapter_model.safetensors").write_bytes(weights)
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "base_model_name_or_path": str(folder), **config}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_a_merged_adapter_is_the_base_fingerprint_plus_the_adapter_files(model, tmp_path):
    base = target_fingerprint(model)
    merged = copy.deepcopy(model)
    with torch.no_grad():
        merged.model.layers[0].mlp.down_proj.weight.add_(0.01)  # what merging changes is not what is compared
    mark_adapter(merged, base, adapter_folder(tmp_path / "a", b"adapter one"))
    saved = target_fingerprint(merged)
    assert fingerprint_mismatch(saved, merged) is None
    assert "has one merged" in fingerprint_mismatch(base, merged)
    assert "this one has none" in fingerprint_mismatch(saved, model)
    other = copy.deepcopy(model)
    mark_adapter(other, base, adapter_folder(tmp_path / "b", b"adapter two"))
    assert "another PEFT adapter" in fingerprint_mismatch(saved, other)
    # The same weights file with another scaling is another model; a copy that names another base path is not.
    mark_adapter(other, base, adapter_folder(tmp_path / "c", b"adapter one", lora_alpha=64))
    assert "another PEFT adapter" in fingerprint_mismatch(saved, other)
    mark_adapter(other, base, adapter_folder(tmp_path / "d", b"adapter one", inference_mode=True))
    assert fingerprint_mismatch(saved, other) is None
    # PEFT saves target_modules from a set: the same adapter saved again may list them in another order
    one = adapter_folder(tmp_path / "e", b"adapter one", target_modules=["q_proj", "v_proj"])
    mark_adapter(merged, base, one)
    mark_adapter(other, base, adapter_folder(tmp_path / "f", b"adapter one", target_modules=["v_proj", "q_proj"]))
    assert fingerprint_mismatch(target_fingerprint(merged), other) is None
    # An artifact that only proposes (a draft, an EAGLE drafter) compares the base weights alone.
    assert fingerprint_mismatch(base, merged, adapter=False) is None


@pytest.mark.parametrize(
    "text, message",
    [
        ("[1, 99]", r"lists token ids outside the target's vocabulary \[0, 16\)"),
        ("[0, 16]", r"lists token ids outside the target's vocabulary \[0, 16\)"),  # (the first id past it)
        ("[-1, 2]", "lists token ids outside the target's vocabulary"),
        ("[1, 2, 1]", "lists a token id more than once"),
        ("[1, 2.5]", "must be a non-empty JSON list of token ids"),  # torch.tensor would have truncated it to 2
        ("[1, true]", "must be a non-empty JSON list of token ids"),
        ("[]", "must be a non-empty JSON list"),
        ('{"0": 1}', "must be a non-empty JSON list"),
    ],
)
def test_vocabulary_lists_that_do_not_fit_the_target_are_named(text, message):
    with pytest.raises(ModelLoadError, match=f"heads 'h': x_vocab.json {message}"):
        check_vocab_ids(json.loads(text), 16, "heads 'h'", "x_vocab.json")
    assert check_vocab_ids([3, 0, 15], 16, "heads 'h'", "x_vocab.json").tolist() == [3, 0, 15]


def test_a_shipped_artifact_is_found_by_its_targets_name_or_weights(model, tmp_path, monkeypatch):
    # A target given by its folder, not its alias (`specframe models list` shows the folder), gets the shipped
    # artifacts all the same: matched by the fingerprint they record; another model gets none.
    import specframe.artifacts as artifacts

    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "medusa_config.json").write_text(json.dumps({"target": target_fingerprint(model)}))
    monkeypatch.setattr(artifacts, "SHIPPED", {("medusa", "tiny"): ("heads", "medusa_config.json")})
    monkeypatch.setattr(artifacts.resources, "files", lambda package: tmp_path)
    path = str(tmp_path / "heads")
    assert artifacts.shipped("medusa", "tiny") == path  # (by its alias, without looking at weights)
    assert artifacts.shipped("medusa", "/models/tiny", model) == path
    assert artifacts.shipped("medusa", "/models/tiny", copy.deepcopy(model).to(torch.bfloat16)) == path
    other = tiny_llama(vocab_size=16, seed=1, hidden_size=32, num_layers=2)
    assert artifacts.shipped("medusa", "/models/other", other) is None
    assert artifacts.shipped("medusa", "/models/tiny") is None  # (no model: the name alone)
    assert artifacts.shipped("eagle", "/models/tiny", model) is None  # (none of that kind ships)


def test_a_folder_that_is_not_the_artifact_asked_for_says_what_it_is(tmp_path):
    # (before: "no medusa_config.json" of a folder that did not exist, "has no config.json (not a Hugging Face
    # model directory)" of Medusa heads given as a draft model, "no eagle_config.json" of an unfinished run)
    from specframe.fingerprint import not_an_artifact
    from specframe.models import load_model

    (tmp_path / "file").write_text("")
    (tmp_path / "heads").mkdir()
    (tmp_path / "heads" / "medusa_config.json").write_text("{}")
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "state.json").write_text('{"epoch": 1}')
    (tmp_path / "empty").mkdir()
    assert not_an_artifact(tmp_path / "nowhere", "medusa") == "does not exist"
    assert not_an_artifact(tmp_path / "file", "medusa") == "is a file, not an artifact folder"
    heads_as_eagle = "holds a trained medusa artifact (medusa_config.json), not an eagle one"
    assert not_an_artifact(tmp_path / "heads", "eagle") == heads_as_eagle
    assert not_an_artifact(tmp_path / "run", "eagle").startswith("holds only the checkpoint of an unfinished training")
    assert f"--proposer eagle out={tmp_path / 'run'} --resume" in not_an_artifact(tmp_path / "run", "eagle")
    assert not_an_artifact(tmp_path / "empty", "draft") == "holds no draft_config.json"
    with pytest.raises(ModelLoadError, match=r"holds a trained medusa artifact .*the proposer.model of the medusa"):
        load_model(str(tmp_path / "heads"), quiet=True)
    (tmp_path / "run" / "checkpoint" / "optim.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"checkpoint is a training run's checkpoint, not a model"):
        load_model(str(tmp_path / "run" / "checkpoint"), quiet=True)


@pytest.mark.parametrize("where", [0, -1])
def test_a_change_at_either_end_of_a_weight_changes_the_fingerprint(model, where):
    # (the sampled numbers are spread over each weight from its first to its last: a sample that stopped short of
    # the last number passed every other test)
    from specframe.fingerprint import SAMPLE

    other = copy.deepcopy(model)
    weight = other.lm_head.weight
    assert weight.numel() > SAMPLE
    with torch.no_grad():
        weight.view(-1)[where] += 1.0
    assert fingerprint_mismatch(target_fingerprint(model), other) is not None


def test_an_artifacts_files_reach_the_disk_before_its_config_makes_it_one(tmp_path, monkeypatch):
    import os

    import specframe.fingerprint as fp

    events: list[str] = []
    monkeypatch.setattr(fp, "sync_to_disk", lambda path: events.append(f"sync {os.path.basename(path)}"))
    monkeypatch.setattr(
        fp.os, "replace", lambda a, b: events.append(f"rename {os.path.basename(b)}") or os.rename(a, b)
    )
    fp.write_artifact(tmp_path, "draft", {"w": torch.ones(2)}, torch.tensor([1, 2]), {"k": 1}, indent=1)
    synced = {e.split()[1] for e in events[: events.index("rename draft_config.json")] if e.startswith("sync")}
    assert synced == {"model.safetensors", "draft_vocab.json", ".draft_config.json.part"}
    assert events[-1] == f"sync {tmp_path.name}" and json.loads((tmp_path / "draft_config.json").read_text()) == {
        "k": 1
    }


def test_the_umask_is_read_without_setting_it_where_the_system_shows_it(monkeypatch):
    import os
    import sys

    import specframe.fingerprint as fp

    expected = os.umask(0o022)
    os.umask(expected)
    if not sys.platform.startswith("linux"):
        pytest.skip("only Linux shows a process's umask in /proc")
    monkeypatch.setattr(fp.os, "umask", lambda *a: pytest.fail("the umask was set to read it"))
    assert fp._process_umask() == expected
