import copy

import torch
from transformers import LlamaForCausalLM

from specframe.data import DistillExample, read_distill
from specframe.testing.tiny import tiny_llama, write_distill_data
from specframe.training.features import extract_features


def test_features_are_the_targets_last_hidden_state_cached_and_order_independent(tmp_path):
    target = tiny_llama(vocab_size=16, hidden_size=32)
    write_distill_data(tmp_path / "d.jsonl", target, n=12)
    examples = read_distill(tmp_path / "d.jsonl")
    first = extract_features(target, examples, dtype=torch.float32, cache_dir=tmp_path / "f", quiet=True)
    assert [s.id for s in first] == sorted(e.id for e in examples)
    by_id = {e.id: e for e in examples}
    for s in first[:3]:
        e = by_id[s.id]
        assert s.ids.tolist() == e.prompt_ids + e.response_ids and s.first_target == len(e.prompt_ids)
        with torch.no_grad():
            expected = target(input_ids=s.ids[None], output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(s.features.float(), expected.to(torch.bfloat16).float())
    assert len(list((tmp_path / "f").iterdir())) == 1
    again = extract_features(target, list(reversed(examples)), dtype=torch.float32, cache_dir=tmp_path / "f")
    assert len(list((tmp_path / "f").iterdir())) == 1  # same examples in another order: the same cache file
    assert all(torch.equal(a.features, b.features) and a.id == b.id for a, b in zip(first, again, strict=True))
    other = tiny_llama(vocab_size=16, hidden_size=32, seed=3)
    extract_features(other, examples, dtype=torch.float32, cache_dir=tmp_path / "f", quiet=True)
    assert len(list((tmp_path / "f").iterdir())) == 2  # another target never reuses the file
    config = copy.deepcopy(target.config)
    config.rope_parameters["rope_theta"] = 10.0
    rotated = LlamaForCausalLM(config).eval()  # the same weights, another forward
    rotated.load_state_dict(target.state_dict())
    changed = extract_features(rotated, examples, dtype=torch.float32, cache_dir=tmp_path / "f", quiet=True)
    assert len(list((tmp_path / "f").iterdir())) == 3  # (it once read the first file: stale features)
    assert not all(torch.equal(a.features, b.features) for a, b in zip(first, changed, strict=True))


def test_extra_layers_are_those_hidden_states_cached_under_their_own_key(tmp_path):
    import pytest

    from specframe.errors import ConfigError

    target = tiny_llama(vocab_size=16, hidden_size=32, num_layers=3)
    write_distill_data(tmp_path / "d.jsonl", target, n=8)
    examples = read_distill(tmp_path / "d.jsonl")
    plain = extract_features(target, examples, dtype=torch.float32, cache_dir=tmp_path / "f", quiet=True)
    assert all(s.extra is None for s in plain)
    fused = extract_features(
        target, examples, dtype=torch.float32, cache_dir=tmp_path / "f", quiet=True, extra_layers=[2, 0]
    )
    assert len(list((tmp_path / "f").iterdir())) == 2  # other layers: another file; the plain one untouched
    for s in fused[:3]:
        with torch.no_grad():
            hs = target(input_ids=s.ids[None], output_hidden_states=True).hidden_states
        expected = torch.cat([hs[2][0], hs[0][0]], -1)  # in the order asked, side by side
        torch.testing.assert_close(s.extra.float(), expected.to(torch.bfloat16).float())
        torch.testing.assert_close(s.features.float(), hs[-1][0].to(torch.bfloat16).float())
    again = extract_features(target, examples, dtype=torch.float32, cache_dir=tmp_path / "f", extra_layers=[2, 0])
    assert all(torch.equal(a.extra, b.extra) for a, b in zip(fused, again, strict=True))  # read back from the cache
    for bad in ([3], [-1], [1, 1]):  # layer 3 of 3 (the normed last) is the feature itself
        with pytest.raises(ConfigError, match="extra_layers"):
            extract_features(target, examples, extra_layers=bad)


def test_fewer_layers_are_read_from_a_file_made_for_more(tmp_path):
    """A trainer that asks for a subset of the extra layers (Medusa and the draft ask for none) reads them from
    the file EAGLE's fused features made, instead of running the target again; other layers, data or targets
    still get their own file."""
    target = tiny_llama(vocab_size=16, hidden_size=32, num_layers=3)
    write_distill_data(tmp_path / "d.jsonl", target, n=8)
    examples = read_distill(tmp_path / "d.jsonl")
    cache = tmp_path / "f"

    def files():
        return sorted(p.name for p in cache.iterdir())

    fused = extract_features(target, examples, dtype=torch.float32, cache_dir=cache, quiet=True, extra_layers=[2, 0])
    (cache / "features-junk.safetensors").write_bytes(b"not a cache file")  # (ignored while looking)
    made = files()
    plain = extract_features(target, examples, dtype=torch.float32, cache_dir=cache, quiet=True)
    assert files() == made and all(s.extra is None for s in plain)
    for a, b in zip(fused, plain, strict=True):
        assert torch.equal(a.features, b.features) and torch.equal(a.ids, b.ids)
    assert [(s.id, s.first_target) for s in plain] == [(s.id, s.first_target) for s in fused]
    for wanted, cols in (([0], [1]), ([0, 2], [1, 0])):  # a column of it, and both in the other order
        part = extract_features(target, examples, dtype=torch.float32, cache_dir=cache, quiet=True, extra_layers=wanted)
        assert files() == made
        for a, b in zip(fused, part, strict=True):
            expected = torch.cat([a.extra[:, c * 32 : (c + 1) * 32] for c in cols], -1)
            assert torch.equal(b.extra, expected) and torch.equal(a.features, b.features)
    extract_features(target, examples, dtype=torch.float32, cache_dir=cache, quiet=True, extra_layers=[1])
    assert len(files()) == 3  # layer 1 is not in the fused file: extracted
    extract_features(target, examples[:-1], dtype=torch.float32, cache_dir=cache, quiet=True)
    other = tiny_llama(vocab_size=16, hidden_size=32, num_layers=3, seed=3)
    extract_features(other, examples, dtype=torch.float32, cache_dir=cache, quiet=True)
    assert len(files()) == 5  # other examples, another target: never read from the fused file


def test_grown_data_runs_the_target_on_the_new_sequences_only(tmp_path, capsys):
    """After another distillation pass is appended, only the new sequences go through the target; the others'
    rows (and the columns of the layers asked for) are copied from the cache files that hold those tokens."""
    target = tiny_llama(vocab_size=16, hidden_size=32, num_layers=3)
    write_distill_data(tmp_path / "d.jsonl", target, n=10)
    examples = sorted(read_distill(tmp_path / "d.jsonl"), key=lambda e: e.id)
    cache = tmp_path / "f"
    first = extract_features(target, examples[:6], dtype=torch.float32, cache_dir=cache, extra_layers=[2, 0])
    capsys.readouterr()
    grown = extract_features(target, examples, dtype=torch.float32, cache_dir=cache, extra_layers=[0])
    assert "6 of 10 sequences copied from earlier cache files; running the target on the other 4" in (
        capsys.readouterr().err
    )
    assert len(list(cache.iterdir())) == 2  # the grown data gets its own file
    fresh = extract_features(target, examples, dtype=torch.float32, extra_layers=[0], quiet=True)  # (no cache)
    for a, b in zip(grown, fresh, strict=True):
        assert a.id == b.id and torch.equal(a.ids, b.ids) and a.first_target == b.first_target
        torch.testing.assert_close(a.features.float(), b.features.float(), atol=0.02, rtol=0.02)
        torch.testing.assert_close(a.extra.float(), b.extra.float(), atol=0.02, rtol=0.02)
    for a, b in zip(first, grown[:6], strict=True):  # copied, not recomputed: exactly the earlier rows
        assert torch.equal(a.features, b.features) and torch.equal(a.extra[:, 32:], b.extra)
    again = extract_features(target, examples, dtype=torch.float32, cache_dir=cache, extra_layers=[0])
    assert all(torch.equal(a.features, b.features) for a, b in zip(grown, again, strict=True))
    assert "copied" not in capsys.readouterr().err  # (its own file now)
    other = tiny_llama(vocab_size=16, hidden_size=32, num_layers=3, seed=3)
    extract_features(other, examples, dtype=torch.float32, cache_dir=cache)
    assert "copied" not in capsys.readouterr().err  # another target copies nothing
    extract_features(target, examples, dtype=torch.float32, cache_dir=cache, extra_layers=[1])
    assert "copied" not in capsys.readouterr().err  # nor does a layer no cached file holds


def test_a_damaged_cache_file_is_named(tmp_path):
    import pytest

    from specframe.errors import BadInputError

    target = tiny_llama(vocab_size=16, hidden_size=32)
    write_distill_data(tmp_path / "d.jsonl", target, n=6)
    examples = read_distill(tmp_path / "d.jsonl")
    extract_features(target, examples, dtype=torch.float32, cache_dir=tmp_path / "f", quiet=True)
    (cached,) = (tmp_path / "f").iterdir()
    cached.write_bytes(cached.read_bytes()[:100])
    with pytest.raises(BadInputError, match=f"the features cache file {cached} cannot be read .*delete it"):
        extract_features(target, examples, dtype=torch.float32, cache_dir=tmp_path / "f", quiet=True)


def distill_example(pid, prompt=(1, 2), resp=(3, 4)):
    return DistillExample(pid, "s", list(prompt), list(resp), True)


# (tests from a mutation review of training, 2026-12-06: each fails on the mutation it is named for)


def test_another_max_length_never_reuses_a_cache_file(tmp_path):
    target = tiny_llama(vocab_size=16, hidden_size=32)
    write_distill_data(tmp_path / "d.jsonl", target, n=8)
    examples = read_distill(tmp_path / "d.jsonl")
    longest = max(len(e.prompt_ids) + len(e.response_ids) for e in examples)
    shortest_prompt = max(len(e.prompt_ids) for e in examples)
    extract_features(target, examples, max_length=longest, cache_dir=tmp_path / "f", quiet=True)
    cut = shortest_prompt + 1
    short = extract_features(target, examples, max_length=cut, cache_dir=tmp_path / "f", quiet=True)
    assert all(len(s.ids) <= cut and s.features.shape[0] == len(s.ids) for s in short)
    assert len(list((tmp_path / "f").glob("features-*.safetensors"))) == 2


def test_another_extraction_dtype_never_reuses_a_cache_file(tmp_path):
    target = tiny_llama(vocab_size=16, hidden_size=32)
    write_distill_data(tmp_path / "d.jsonl", target, n=6)
    examples = read_distill(tmp_path / "d.jsonl")
    extract_features(target, examples, dtype=torch.bfloat16, cache_dir=tmp_path / "f", quiet=True)
    extract_features(target, examples, dtype=torch.float32, cache_dir=tmp_path / "f", quiet=True)
    assert len(list((tmp_path / "f").glob("features-*.safetensors"))) == 2


def test_other_responses_under_the_same_ids_never_reuse_a_cache_file(tmp_path):
    target = tiny_llama(vocab_size=16, hidden_size=32)
    a = [distill_example("a", (1, 2, 3), (4, 5, 6)), distill_example("b", (2, 3), (7, 8))]
    b = [distill_example("a", (1, 2, 3), (9, 9, 9)), distill_example("b", (2, 3), (7, 8))]
    extract_features(target, a, cache_dir=tmp_path / "f", quiet=True)
    got = extract_features(target, b, cache_dir=tmp_path / "f", quiet=True)
    assert got[0].ids.tolist() == [1, 2, 3, 9, 9, 9]


def test_cache_saves_write_files_of_their_own_and_leave_nothing_when_interrupted(tmp_path, monkeypatch):
    # (trainers of one sweep sharing the cache saved the same key through one fixed temp name: the second one's
    # rename failed after all its extraction work, and a reader could open the file the second was writing)
    from pathlib import Path

    import pytest

    from specframe.training import features

    written = []
    real = features.save_weights

    def spy(tensors, path, metadata=None):
        written.append(Path(path))
        real(tensors, path, metadata)

    monkeypatch.setattr(features, "save_weights", spy)
    target = tmp_path / "features-k.safetensors"
    for _ in range(2):
        features._save(target, {"x": torch.ones(2)}, {"a": "b"})
    assert len(set(written)) == 2 and all(p.parent == tmp_path and p != target for p in written)
    assert [p.name for p in tmp_path.iterdir()] == [target.name]

    def interrupted(tensors, path, metadata=None):
        Path(path).write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(features, "save_weights", interrupted)
    with pytest.raises(KeyboardInterrupt):
        features._save(tmp_path / "features-j.safetensors", {"x": torch.ones(2)}, {})
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
    # A killed save (SIGKILL, out of memory) leaves its temp file: the next save removes it once it is stale, and
    # leaves a younger one (another trainer's, being written) alone.
    import os
    import time

    killed, writing = tmp_path / "features-j.abc.tmp", tmp_path / "features-k.def.tmp"
    killed.write_bytes(b"x")
    writing.write_bytes(b"x")
    old = time.time() - features.STALE_SAVE_S - 1
    os.utime(killed, (old, old))
    monkeypatch.setattr(features, "save_weights", real)
    features._save(target, {"x": torch.ones(2)}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [writing.name, target.name]
