"""``tools/transformers_sweep.py`` builds transformers' architectures from
tiny configs and sorts each case into passed / refused / failed: a case of
each kind it meets, so that the sweep keeps working as transformers moves."""
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: tools
from tools import transformers_sweep as sweep  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_tiny_config_keeps_a_layer_pattern_and_its_full_attention_layer():
    import transformers
    config = sweep.shrink(transformers.Gemma3TextConfig())
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (sweep.WIDTH, 2, sweep.VOCAB)
    assert config.layer_types == ["sliding_attention", "full_attention"]
    assert config.use_cache is False


def _run(model, mode="train"):
    return sweep.run_case(sweep.Case(model, mode), timeout=300, max_params=20e6, data_dependent="refuse",
                          reexport=False)


def test_a_decoder_passes():
    result = _run("llama")
    assert (result.status, result.detail) == (sweep.PASSED, "")
    assert 0 < result.params < 1e6


def test_a_refusal_records_its_reason_and_what_torch_export_does():
    """wav2vec2 in train mode draws its masks with numpy: refused, and the
    record says why and what torch.export does with the same case."""
    result = _run("wav2vec2")
    assert result.status == sweep.REFUSED and result.detail.startswith("ExportError: ")
    assert "numpy.random" in result.detail
    assert result.extra["torch_export"]  # "exports" or torch's error class
