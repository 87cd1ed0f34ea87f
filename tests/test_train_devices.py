"""Every trainer on every available device (CPU here; CUDA too where present): batches and cached features
are built on the CPU and must reach the target's device; the artifacts must then propose exactly."""

import pytest
import torch

from specframe import SpeculativeDecoder
from specframe.decoder import target_info
from specframe.proposers.draft import DraftConfig, DraftProposer
from specframe.proposers.eagle import EagleConfig, EagleProposer
from specframe.proposers.medusa import MedusaConfig, MedusaProposer
from specframe.testing.conformance import reference_greedy
from specframe.testing.tiny import available_devices, tiny_llama, write_distill_data
from specframe.training.draft import DraftTrainConfig, train_draft
from specframe.training.eagle import EagleTrainConfig, train_eagle
from specframe.training.medusa import MedusaTrainConfig, train_medusa


@pytest.mark.parametrize("device", available_devices())
def test_every_trainer_runs_on_the_target_s_device(device, tmp_path):
    target = tiny_llama(vocab_size=16, seed=0, hidden_size=32, num_layers=2, device=device)
    write_distill_data(tmp_path / "d.jsonl", target, n=24, response_length=8)
    common = dict(data=str(tmp_path / "d.jsonl"), epochs=1, vocab_size=12, heldout_fraction=0.25, batch_size=4)
    quiet = dict(log=lambda m: None)
    train_draft(
        DraftTrainConfig(**common, out=str(tmp_path / "draft"), layers=1, features_cache=""), target, None, **quiet
    )
    train_medusa(
        MedusaTrainConfig(**common, out=str(tmp_path / "medusa"), num_heads=2, features_cache=""), target, None, **quiet
    )
    train_eagle(EagleTrainConfig(**common, out=str(tmp_path / "eagle"), features_cache=""), target, None, **quiet)
    info = target_info(target)
    proposers = [
        # (with the shape chosen at load every step: re-chosen by acceptance, a tiny draft's might be plain steps)
        DraftProposer.from_config(DraftConfig(model=str(tmp_path / "draft"), adapt_shape=False), info),
        MedusaProposer.from_config(MedusaConfig(model=str(tmp_path / "medusa")), info),
        EagleProposer.from_config(EagleConfig(model=str(tmp_path / "eagle"), adapt_shape=False), info),
    ]
    expected = reference_greedy(target, [1, 2, 3], 12)
    for proposer in proposers:
        decoder = SpeculativeDecoder(target, proposer)
        assert decoder.generate([1, 2, 3], max_new_tokens=12).token_ids == expected
        # sampling runs the residual and q paths on the device too; a seed repeats it, token for token
        sampled = [decoder.generate([1, 2, 3], max_new_tokens=12, temperature=1.0, top_k=8, seed=5) for _ in "ab"]
        assert sampled[0].token_ids == sampled[1].token_ids and all(0 <= t < 16 for t in sampled[0].token_ids)
        assert sampled[0].stats["proposed_tokens"] > 0
    # Medusa-2: LoRA through PEFT on the target's device (training only: loading needs the adapter merged).
    stage2 = MedusaTrainConfig(**common, out=str(tmp_path / "m2"), stage=2, num_heads=2, lora_rank=2, features_cache="")
    train_medusa(stage2, target, None, **quiet)
    assert (tmp_path / "m2" / "adapter" / "adapter_model.safetensors").is_file()
    assert all(p.device.type == torch.device(device).type for p in target.parameters())
