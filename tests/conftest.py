import pytest

from specframe.decoder import target_info
from specframe.testing.tiny import one_thread, tiny_llama


@pytest.fixture(autouse=True)
def single_threaded():
    with one_thread():  # tiny models run fastest single-threaded
        yield


@pytest.fixture
def changes_global_rng():
    """A check: whether `build()` moved torch's global generator (seeded 0 before it: the next draws are compared
    with seed 0's own). Building a proposer from trained weights must not: a user's `torch.manual_seed(0)`,
    decoder build, `torch.rand(...)` gives the numbers of no build."""
    import torch

    def check(build) -> bool:
        torch.manual_seed(0)
        expected = torch.rand(4)
        torch.manual_seed(0)
        build()
        return not torch.equal(torch.rand(4), expected)

    return check


@pytest.fixture
def kept_timings(monkeypatch, tmp_path):
    """Timings kept on disk (off elsewhere in the tests: ../conftest.py), under a temporary cache root."""
    from specframe import measurements

    monkeypatch.setenv("SPECFRAME_HOME", str(tmp_path))
    monkeypatch.setenv(measurements.KEEP_ENV, "1")
    return tmp_path


@pytest.fixture
def unwritable_folder():
    """A folder where nothing can be made, even by root (the tests may run as root, where chmod would not do)."""
    import os
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(dir="/sys"))
    except OSError:
        return "/sys"
    pytest.skip("no unwritable folder on this machine (/sys)")


@pytest.fixture
def target():
    return tiny_llama(vocab_size=8, seed=0)


@pytest.fixture
def info(target):
    return target_info(target)


def save_tiny_model(path, vocab_size=8, seed=0, tokenizer=True, max_position_embeddings=256):
    """A tiny random Llama saved as a Hugging Face directory (safetensors), optionally with a word tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_llama(vocab_size=vocab_size, seed=seed, max_position_embeddings=max_position_embeddings)
    model.save_pretrained(path)
    if tokenizer:
        words = ["<unk>", "<eos>"] + [chr(ord("a") + i) for i in range(vocab_size - 2)]
        tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
        fast.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {
        "target": save_tiny_model(root / "target", seed=0),
        "draft": save_tiny_model(root / "draft", seed=1),
        "bare": save_tiny_model(root / "bare", seed=0, tokenizer=False),
        "wide": save_tiny_model(root / "wide", vocab_size=12, seed=2),
        "short": save_tiny_model(root / "short", seed=0, max_position_embeddings=8),
    }
