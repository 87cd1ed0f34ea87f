"""An interrupted training run, resumed with `--resume`, ends with the same weights as a run never interrupted:
the checkpoint restores the weights, the optimizer's moments, the learning-rate schedule and the data order."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file

from specframe.data import read_distill
from specframe.errors import ConfigError
from specframe.testing.tiny import tiny_llama, write_distill_data
from specframe.training.common import split_heldout
from specframe.training.draft import DraftTrainConfig, train_draft
from specframe.training.eagle import EagleTrainConfig, train_eagle
from specframe.training.medusa import MedusaTrainConfig, train_medusa

COMMON = dict(epochs=3, lr=1e-2, batch_size=8, heldout_fraction=0.2, vocab_size=12)
TRAINERS = {
    "draft": (train_draft, lambda **kw: DraftTrainConfig(layers=1, **kw)),
    "medusa": (train_medusa, lambda **kw: MedusaTrainConfig(num_heads=2, tree_nodes=4, **kw)),
    "medusa-2": (train_medusa, lambda **kw: MedusaTrainConfig(stage=2, num_heads=2, tree_nodes=4, lora_rank=2, **kw)),
    "eagle": (train_eagle, lambda **kw: EagleTrainConfig(fuse_layers=[0, 1], **kw)),
}


class Interrupted(Exception):
    pass


def interrupt_at(text: str):
    """A `log` that stops the run (as Ctrl-C would) when it is about to report `text`: for "epoch 2:" that is
    after epoch 2's training and before its checkpoint, so the resumed run redoes epoch 2."""

    def log(message: str) -> None:
        if message.startswith(text):
            raise Interrupted(message)

    return log


def weights(folder) -> dict[str, torch.Tensor]:
    """A run's trained tensors: the saved model's, and a Medusa-2 run's adapter's."""
    found = load_file(f"{folder}/model.safetensors")
    if (folder / "adapter").is_dir():
        found.update({f"adapter.{k}": v for k, v in load_file(f"{folder}/adapter/adapter_model.safetensors").items()})
    return found


@pytest.mark.parametrize("name", list(TRAINERS))
def test_an_interrupted_run_resumed_ends_where_an_uninterrupted_one_does(tmp_path, name):
    train, make = TRAINERS[name]
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=40)

    def run(out: str, **kw):  # a fresh target each time: stage 2 adapts the model it is given
        target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
        cfg = make(data=str(data), out=str(tmp_path / out), features_cache=str(tmp_path / "features"), **COMMON)
        return train(cfg, target, None, **kw)

    straight = run("straight", log=lambda m: None)
    umask = os.umask(0)
    os.umask(umask)
    saved = [*(tmp_path / "straight").rglob("*.safetensors"), *(tmp_path / "features").rglob("*.safetensors")]
    modes = {str(f.relative_to(tmp_path)): oct(f.stat().st_mode & 0o777) for f in saved}
    assert len(saved) >= 3 and set(modes.values()) == {oct(0o666 & ~umask)}, modes  # (safetensors makes 0600)
    with pytest.raises(Interrupted):
        run("resumed", log=interrupt_at("epoch 2:"))
    after_epoch_1 = load_file(tmp_path / "resumed" / "checkpoint" / "model.safetensors")
    logs: list[str] = []
    resumed = run("resumed", resume=True, log=logs.append)
    assert any("resumed" in m and "epoch 1" in m for m in logs), logs
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    assert [h["epoch"] for h in resumed["history"]] == [h["epoch"] for h in straight["history"]]
    # Not vacuous: the resumed run trained on from epoch 1's checkpoint.
    last = load_file(tmp_path / "resumed" / "checkpoint" / "model.safetensors")
    assert last.keys() == after_epoch_1.keys() and any(not torch.equal(last[k], after_epoch_1[k]) for k in last)
    # Not vacuous: the weights moved from where epoch 1 left them.


@pytest.mark.parametrize("name", list(TRAINERS))
def test_a_run_stopped_within_an_epoch_resumes_at_its_last_checkpoint_as_if_never_stopped(tmp_path, name, monkeypatch):
    """With train.checkpoint_every, a checkpoint is saved within epochs too; a run stopped two steps past the one
    in epoch 2 resumes at the batch after it (the schedule, running loss and EAGLE's noise generator restored)
    and ends with the weights and losses of a run never stopped and never checkpointed within an epoch."""

    from specframe.training import common

    train, make = TRAINERS[name]
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=40)

    def run(out: str, every: int, **kw):
        target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
        options = {**COMMON, "batch_size": 4, "checkpoint_every": every, "checkpoint_minutes": 0}  # (8 batches)
        cfg = make(data=str(data), out=str(tmp_path / out), features_cache=str(tmp_path / "f"), **options)
        return train(cfg, target, None, **kw)

    straight = run("straight", every=0, log=lambda m: None)
    saved: list[dict] = []
    real_save, real_step = common.save_checkpoint, common.optimizer_step
    steps, armed = [0, 0], [True]  # (steps in all and since the last save; the stop, once)

    def save(folder, params, optimizer, state):
        real_save(folder, params, optimizer, state)
        saved.append(json.loads(json.dumps(state)))
        steps[1] = 0

    def step(*args, **kwargs):
        if armed[0] and saved and saved[-1]["epoch"] == 1 and "within" in saved[-1] and steps[1] == 2:
            armed[0] = False
            raise Interrupted("two steps past epoch 2's first checkpoint within it")
        steps[0] += 1
        steps[1] += 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(common, "save_checkpoint", save)
    monkeypatch.setattr(common, "optimizer_step", step)  # (run_epochs' own, every trainer's)
    with pytest.raises(Interrupted):
        run("resumed", every=3, log=lambda m: None)
    within = saved[-1]
    assert within["within"]["batches"] >= 1 and within["steps"] == steps[0] - 2, within
    assert [s["epoch"] for s in saved if "within" not in s] == [1]  # (epoch 1's end, and checkpoints within)
    done = steps[0]
    logs: list[str] = []
    resumed = run("resumed", every=3, resume=True, log=logs.append)
    assert f"after {within['within']['batches']} batches of epoch 2" in " ".join(logs), logs
    a, b = weights(tmp_path / "straight"), weights(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    losses = [(h["epoch"], h.get("train_loss", h.get("train_kl")), h.get("keep_kl")) for h in straight["history"]]
    assert losses == [
        (h["epoch"], h.get("train_loss", h.get("train_kl")), h.get("keep_kl")) for h in resumed["history"]
    ]
    # Not vacuous: the resumed run took only the steps after the checkpoint, and checkpoints were made within epochs.
    total = json.loads((tmp_path / "straight" / "checkpoint" / "state.json").read_text())["steps"]
    assert steps[0] - done == total - within["steps"], (steps, within, total)
    assert sum("within" in s for s in saved) >= 2


@pytest.mark.parametrize("name", list(TRAINERS))
def test_a_new_run_never_overwrites_another_run_s_out_folder(tmp_path, name):
    """Without --resume, an out folder holding a checkpoint or trained weights is refused (it was overwritten)."""
    import shutil

    from specframe.errors import ConfigError

    train, make = TRAINERS[name]
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=40)

    def run(**kw):
        target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
        cfg = make(data=str(data), out=str(tmp_path / "out"), features_cache=str(tmp_path / "f"), **{**COMMON, **kw})
        return train(cfg, target, None, log=lambda m: None)

    run(epochs=1)
    saved = (tmp_path / "out" / "model.safetensors").read_bytes()
    with pytest.raises(
        ConfigError, match=r"train.out .* holds the checkpoint of another run \(after epoch 1\): add --resume"
    ):
        run(epochs=1, lr=5e-3)
    shutil.rmtree(tmp_path / "out" / "checkpoint")  # a folder holding only a trained artifact
    with pytest.raises(ConfigError, match=r"already holds trained weights .*: train into another train.out"):
        run(epochs=1, lr=5e-3)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == saved


def forbid_feature_extraction(monkeypatch) -> None:
    """From here on, a trainer that extracts the target's features fails the test (a refusal must come first)."""
    from specframe.training import draft, features

    def no_features(*args, **kwargs):
        raise AssertionError("the features were extracted before the refusal")

    monkeypatch.setattr(features, "split_features", no_features)  # (eagle's and medusa's import it when they run)
    monkeypatch.setattr(draft, "split_features", no_features)


@pytest.mark.parametrize("name", list(TRAINERS))
def test_resume_on_another_target_is_refused(tmp_path, name, monkeypatch):
    """A checkpoint continues only on the target it was trained with: another one of the same shapes (another
    seed) is refused by its fingerprint before any feature extraction, and the checkpoint is left as it was."""
    from specframe.errors import ConfigError

    train, make = TRAINERS[name]
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=40)

    def run(seed: int, **kw):
        target = tiny_llama(vocab_size=16, seed=seed, hidden_size=32, num_layers=2)
        cfg = make(data=str(data), out=str(tmp_path / "out"), features_cache=str(tmp_path / "f"), **COMMON)
        return train(cfg, target, None, **kw)

    with pytest.raises(Interrupted):
        run(0, log=interrupt_at("epoch 2:"))
    state = (tmp_path / "out" / "checkpoint" / "state.json").read_text()
    logs: list[str] = []
    with monkeypatch.context() as patched:
        forbid_feature_extraction(patched)
        with pytest.raises(ConfigError, match=r"checkpoint in .* was trained with another target: the weights differ"):
            run(1, resume=True, log=logs.append)
    assert any("were written by another model than this target" in m for m in logs), logs  # (the data's seed-0)
    assert (tmp_path / "out" / "checkpoint" / "state.json").read_text() == state
    if name == "medusa-2":  # (the refused run leaves the caller's target without PEFT's adapter layers)
        other = tiny_llama(vocab_size=16, seed=1, hidden_size=32, num_layers=2)
        before = {k: v.clone() for k, v in other.state_dict().items()}
        cfg = make(data=str(data), out=str(tmp_path / "out"), features_cache=str(tmp_path / "f"), **COMMON)
        with pytest.raises(ConfigError, match="trained with another target"):
            train(cfg, other, None, resume=True, log=lambda m: None)
        after = other.state_dict()
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    logs.clear()
    run(0, resume=True, log=logs.append)  # (its own target resumes, and wrote the data)
    assert not any("another model" in m for m in logs) and any("resumed" in m for m in logs), logs


def test_a_run_killed_during_its_first_checkpoint_leaves_none(tmp_path):
    from specframe.training.common import recovered, save_checkpoint

    weight = torch.nn.Parameter(torch.zeros(2))
    ckpt = tmp_path / "checkpoint"
    save_checkpoint(ckpt, {"w": weight}, torch.optim.AdamW([weight]), {"epoch": 1})
    tmp = ckpt.rename(ckpt.with_name("checkpoint.tmp"))
    (tmp / "state.json").rename(tmp / "state.json.part")  # (killed before its state was whole)
    assert not recovered(ckpt).exists()  # (a resume then says there is no checkpoint; a new run starts)


@pytest.mark.parametrize("killed", ["after the old checkpoint moved aside", "while the new one was written"])
def test_a_run_killed_while_saving_a_checkpoint_keeps_a_whole_one(tmp_path, killed):
    import shutil

    from specframe.training.common import recovered, save_checkpoint

    weight = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.AdamW([weight])
    ckpt = tmp_path / "checkpoint"
    save_checkpoint(ckpt, {"w": weight}, optimizer, {"epoch": 1})
    save_checkpoint(ckpt.with_name("next"), {"w": weight + 1}, optimizer, {"epoch": 2})
    # What save_checkpoint of epoch 2 leaves when killed between its steps:
    ckpt.rename(ckpt.with_name("checkpoint.old"))  # the old one moved aside...
    shutil.move(ckpt.with_name("next"), ckpt.with_name("checkpoint.tmp"))  # ...the new one whole, not yet in place
    if killed == "while the new one was written":
        ckpt.with_name("checkpoint.old").rename(ckpt)
        (ckpt.with_name("checkpoint.tmp") / "state.json").unlink()  # (written last)
    epoch = 2 if killed == "after the old checkpoint moved aside" else 1
    assert (recovered(ckpt) / "state.json").read_text().count(f'"epoch": {epoch}') == 1
    assert load_file(ckpt / "model.safetensors")["w"].tolist() == [epoch - 1.0] * 2
    assert not ckpt.with_name("checkpoint.old").exists()
    save_checkpoint(ckpt, {"w": weight}, optimizer, {"epoch": 3})  # (a cut save's leftovers are replaced)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]


def test_a_checkpoint_is_on_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    import os

    from specframe.training import common

    events = []
    monkeypatch.setattr(common.os, "fsync", lambda fd: events.append(("sync", os.readlink(f"/proc/self/fd/{fd}"))))
    real_replace = os.replace
    monkeypatch.setattr(common.os, "replace", lambda a, b: (events.append(("replace", str(b))), real_replace(a, b)))
    weight = torch.nn.Parameter(torch.zeros(2))
    common.save_checkpoint(tmp_path / "checkpoint", {"w": weight}, torch.optim.AdamW([weight]), {"epoch": 1})
    tmp = str(tmp_path / "checkpoint.tmp")
    renamed = events.index(("replace", f"{tmp}/state.json"))
    synced = {path for kind, path in events[:renamed] if kind == "sync"}
    assert synced == {f"{tmp}/model.safetensors", f"{tmp}/optim.safetensors", f"{tmp}/state.json.part"}, events
    assert ("sync", str(tmp_path)) in events[renamed:]  # (the folders' renames too)


DAMAGE = {
    "state cut short": lambda c: (c / "state.json").write_text('{"epoch": 1,\n'),
    "epoch not a number": lambda c: (c / "state.json").write_text('{"epoch": "x"}'),
    "weights missing": lambda c: (c / "model.safetensors").unlink(),
    "optimizer cut short": lambda c: (c / "optim.safetensors").write_bytes((c / "optim.safetensors").read_bytes()[:6]),
    "no history": lambda c: (c / "state.json").write_text('{"epoch": 1}'),
    "no epoch": lambda c: (c / "state.json").write_text('{"history": []}'),
    "within an epoch, batches not a count": lambda c: (c / "state.json").write_text(
        '{"epoch": 1, "history": [], "within": {"batches": -1}}'
    ),
    "within an epoch, generator state not base64": lambda c: (c / "state.json").write_text(
        '{"epoch": 1, "history": [], "within": {"batches": 2, "generator": "not base64!"}}'
    ),
    "within an epoch, a mean's sum not a finite number": lambda c: (c / "state.json").write_text(
        '{"epoch": 1, "history": [], "within": {"batches": 2, "means": {"keep_kl": ["inf", 2]}}}'
    ),
    "within an epoch, a mean counting more batches than were done": lambda c: (c / "state.json").write_text(
        '{"epoch": 1, "history": [], "within": {"batches": 2, "means": {"keep_kl": [0.5, 99]}}}'
    ),
}


@pytest.mark.parametrize("name", ["draft", "eagle"])  # (eagle reads its checkpoint's state for its own checks too)
def test_a_damaged_checkpoint_is_named_before_any_feature_extraction(tmp_path, name, monkeypatch):
    # (before: exit 1 with "Expecting value: line 2 column 1", "'<' not supported between instances of 'int' and
    # 'str'", a bare missing-file error or safetensors' "invalid header length", some after the features)
    import shutil

    from specframe.errors import ConfigError

    train, make = TRAINERS[name]
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=40)

    def run(out, **kw):
        target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
        cfg = make(data=str(data), out=str(out), features_cache=str(tmp_path / "f"), **COMMON)
        return train(cfg, target, None, **kw)

    with pytest.raises(Interrupted):
        run(tmp_path / "run", log=interrupt_at("epoch 2:"))
    forbid_feature_extraction(monkeypatch)
    for i, damage in enumerate(DAMAGE.values()):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(tmp_path / "run", copy)
        damage(copy / "checkpoint")
        with pytest.raises(ConfigError, match=r"^the checkpoint in .*checkpoint is damaged \(.*\): it cannot be"):
            run(copy, resume=True, log=lambda m: None)


@pytest.mark.parametrize("minutes, within", [(0.0, False), (1e-9, True)])
def test_checkpoints_within_an_epoch_come_by_time(tmp_path, monkeypatch, minutes, within):
    """train.checkpoint_minutes (10 by default) saves one within an epoch once that long has passed since the last
    (here: at once, or never), whatever the steps (checkpoint_every 0)."""
    from specframe.training import common

    train, make = TRAINERS["draft"]
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=40)
    states: list[dict] = []
    real = common.save_checkpoint
    monkeypatch.setattr(common, "save_checkpoint", lambda f, p, o, state: states.append(state) or real(f, p, o, state))
    options = {**COMMON, "epochs": 1, "checkpoint_every": 0, "checkpoint_minutes": minutes}
    cfg = make(data=str(data), out=str(tmp_path / "out"), features_cache=str(tmp_path / "f"), **options)
    train(cfg, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), None, log=lambda m: None)
    batches = [s["within"]["batches"] for s in states if "within" in s]
    assert batches == ([1, 2, 3] if within else []) and states[-1]["epoch"] == 1  # (4 batches: the last ends it)
    assert make(data=str(data), out=str(tmp_path / "x")).checkpoint_minutes == 10.0


def test_a_checkpoint_within_an_epoch_is_named_by_its_batch_and_needs_that_epoch_to_end(tmp_path):
    import shutil

    train, make = TRAINERS["draft"]
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=40)

    def run(out, **kw):
        target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
        options = {**COMMON, **kw.pop("options", {})}
        return train(
            make(data=str(data), out=str(out), features_cache=str(tmp_path / "f"), **options), target, None, **kw
        )

    with pytest.raises(ConfigError, match=r"train.checkpoint_every must be >= 0 \(0: none by steps\), got -1"):
        make(data=str(data), out=str(tmp_path / "x"), checkpoint_every=-1)
    for minutes in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match=r"train.checkpoint_minutes must be a finite number >= 0 \(0: none by"):
            make(data=str(data), out=str(tmp_path / "x"), checkpoint_minutes=minutes)
    with pytest.raises(Interrupted):
        run(tmp_path / "run", log=interrupt_at("epoch 2:"))
    state_file = tmp_path / "run" / "checkpoint" / "state.json"
    state = json.loads(state_file.read_text())
    state_file.write_text(json.dumps({**state, "within": {"batches": 2, "running": 1.5, "seconds": 3.0}}))
    with pytest.raises(ConfigError, match=r"holds the checkpoint of another run \(after 2 batches of epoch 2\)"):
        run(tmp_path / "run", log=lambda m: None)
    with pytest.raises(
        ConfigError,
        match=r"saved after 2 batches of epoch 2: train.epochs=1 would not finish that epoch; give train.epochs >= 2",
    ):
        run(tmp_path / "run", options={"epochs": 1}, resume=True, log=lambda m: None)
    shutil.copytree(tmp_path / "run", tmp_path / "past")  # an epoch of 4 batches has no batch 9
    (tmp_path / "past" / "checkpoint" / "state.json").write_text(json.dumps({**state, "within": {"batches": 9}}))
    with pytest.raises(ConfigError, match=r"is damaged \(it is after 9 batches of epoch 2, which has 4\)"):
        run(tmp_path / "past", resume=True, log=lambda m: None)


def one_epoch_run(name, tmp_path, data, **options):
    """A fresh tiny target, and trainer `name`'s config (TRAINERS' and COMMON's, one epoch) on `data`."""
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
    make = TRAINERS[name][1]
    common = {**COMMON, "epochs": 1}
    return target, make(
        data=str(data), out=str(tmp_path / "out"), features_cache=str(tmp_path / "f"), **common, **options
    )


# (tests from a mutation review of training, 2026-12-06: each fails on the mutation it is named for)


def test_resume_on_data_with_other_responses_under_the_same_ids_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=20)
    target, cfg = one_epoch_run("medusa", tmp_path, data)
    train_medusa(cfg, target, None, log=lambda m: None)
    held = {e.id for e in split_heldout(read_distill(data), 0.2, 0)[1]}
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    row = next(r for r in rows if r["id"] not in held and r["response_ids"] != r["response_ids"][::-1])
    row["response_ids"] = row["response_ids"][::-1]  # same id and token counts (same vocabulary), other response
    (tmp_path / "d2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    target, cfg2 = one_epoch_run("medusa", tmp_path, tmp_path / "d2.jsonl")
    cfg2.epochs = 2
    with pytest.raises(ConfigError, match="another training data"):
        train_medusa(cfg2, target, None, resume=True, log=lambda m: None)


def test_resume_with_other_prompt_positions_is_refused(tmp_path):
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=20)
    target, cfg = one_epoch_run("medusa", tmp_path, data)
    train_medusa(cfg, target, None, log=lambda m: None)
    target, cfg2 = one_epoch_run("medusa", tmp_path, data, prompt_positions=True)
    cfg2.epochs = 2
    with pytest.raises(ConfigError, match=r"train\.prompt_positions=False, not True"):
        train_medusa(cfg2, target, None, resume=True, log=lambda m: None)


def test_a_run_killed_after_its_last_checkpoint_resumes_with_the_same_epochs_and_saves(tmp_path, monkeypatch):
    import specframe.training.draft as draft_module

    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=20)
    target, cfg = one_epoch_run("draft", tmp_path, data)
    real = draft_module.save_shared_draft

    def killed(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(draft_module, "save_shared_draft", killed)
    with pytest.raises(KeyboardInterrupt):
        train_draft(cfg, target, None, log=lambda m: None)
    monkeypatch.setattr(draft_module, "save_shared_draft", real)
    target, cfg = one_epoch_run("draft", tmp_path, data)
    final = train_draft(cfg, target, None, resume=True, log=lambda m: None)
    assert (tmp_path / "out" / "draft_config.json").is_file()
    assert [h["epoch"] for h in final["history"]] == [0, 1]


@pytest.mark.parametrize("name", list(TRAINERS))
def test_a_resumed_run_killed_while_saving_leaves_no_artifact_of_two_runs(tmp_path, name, monkeypatch):
    # (a finished run resumed with more epochs wrote its weights over the old ones, then its config: killed in
    # between, the folder loaded as whole, the new weights with the old run's epochs, metrics and γ statistics)
    import specframe.fingerprint
    from specframe.decoder import target_info
    from specframe.errors import ModelLoadError
    from specframe.proposers.draft import DraftConfig, DraftProposer
    from specframe.proposers.eagle import EagleConfig, EagleProposer
    from specframe.proposers.medusa import MedusaConfig, MedusaProposer

    train, make = TRAINERS[name]
    kind = name.split("-")[0]
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=40)

    def run(epochs: int, **kw):
        target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2)
        common = {**COMMON, "epochs": epochs}
        cfg = make(data=str(data), out=str(tmp_path / "out"), features_cache=str(tmp_path / "f"), **common)
        return train(cfg, target, None, log=lambda m: None, **kw), target

    _, target = run(2)
    assert (tmp_path / "out" / f"{kind}_config.json").is_file()
    real = specframe.fingerprint.save_weights

    def killed_after_writing(tensors, path, *args, **kwargs):
        real(tensors, path, *args, **kwargs)
        if str(path).endswith("out/model.safetensors"):  # (the artifact's weights, not a checkpoint's)
            raise Interrupted("killed")

    monkeypatch.setattr(specframe.fingerprint, "save_weights", killed_after_writing)  # (every saver's write_artifact)
    with pytest.raises(Interrupted):
        run(3, resume=True)
    assert not (tmp_path / "out" / f"{kind}_config.json").exists()
    proposer, config = {
        "draft": (DraftProposer, DraftConfig),
        "medusa": (MedusaProposer, MedusaConfig),
        "eagle": (EagleProposer, EagleConfig),
    }[kind]
    info = target_info(target)
    with pytest.raises(ModelLoadError, match=r"holds only the checkpoint of an unfinished training run .*--resume"):
        proposer.from_config(config(model=str(tmp_path / "out")), info)
    monkeypatch.undo()
    metrics, target = run(3, resume=True)  # (what the message says: the resumed run saves it whole)
    saved = json.loads((tmp_path / "out" / f"{kind}_config.json").read_text())
    assert saved["train_config"]["epochs"] == 3, saved.get("train_config")


def test_a_second_training_run_into_the_same_out_is_refused(tmp_path, capsys):
    # (two runs into one out folder both finished, one's weights beside the other's config and metrics)
    import fcntl

    from specframe.cli import main
    from specframe.errors import BadInputError

    train, make = TRAINERS["draft"]
    data = tmp_path / "d.jsonl"
    write_distill_data(data, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), n=40)
    cfg = make(data=str(data), out=str(tmp_path / "out"), features_cache=str(tmp_path / "f"), **COMMON)
    held = os.open(tmp_path / ".out.lock", os.O_RDWR | os.O_CREAT)  # (the lock beside it, as another run holds it)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        busy = "train.out '.*out' is being written by another training run: wait for it to end (it can then be "
        with pytest.raises(BadInputError, match=re.escape(busy).replace(r"\.\*", ".*") + r"resumed with --resume\)"):
            train(cfg, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), None, log=lambda m: None)
        capsys.readouterr()
        argv = ["train", "--proposer", "draft", "--target", str(tmp_path / "absent"), f"out={tmp_path / 'out'}"]
        assert main([*argv, f"data={data}"]) == 2
        err = capsys.readouterr().err
        assert "is being written by another training run" in err and "absent" not in err, err  # (before the load)
    finally:
        os.close(held)
    assert not (tmp_path / "out").exists()
    train(cfg, tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2), None, log=lambda m: None)
    assert (tmp_path / "out" / "draft_config.json").is_file() and not (tmp_path / ".out.lock").exists()


def test_a_training_command_interrupted_says_where_its_checkpoint_is(tmp_path, tiny_dirs, capsys, monkeypatch):
    import specframe.training.common
    from specframe.cli import main
    from specframe.models import load_model

    data = tmp_path / "d.jsonl"
    write_distill_data(data, load_model(str(tiny_dirs["target"]), quiet=True).model, n=40)
    real = specframe.training.common.save_checkpoint

    def then_ctrl_c(*args, **kwargs):  # (Ctrl-C just after epoch 1's checkpoint)
        real(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(specframe.training.common, "save_checkpoint", then_ctrl_c)
    out = tmp_path / "out"
    argv = ["train", "--proposer", "draft", "--target", str(tiny_dirs["target"]), f"out={out}", f"data={data}"]
    assert main([*argv, "epochs=3", "layers=1", "heldout_fraction=0.2", f"features_cache={tmp_path / 'f'}"]) == 130
    err = capsys.readouterr().err
    assert f"the last checkpoint (after epoch 1) is in {out}/checkpoint: continue with --resume and the same" in err
    assert err.rstrip().endswith("specframe: interrupted"), err
