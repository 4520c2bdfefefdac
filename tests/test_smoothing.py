"""SmoothQuant folding leaves the fp32 function unchanged, for every architecture (GQA groups,
q/k/v biases, q/k norms), and the calibration is reproducible."""
import pytest
import torch

from prism_backend.engine.forest_builder import build_forest
from prism_backend.model.loader import load_model
from prism_backend.model.smoothing import apply_smoothing, calibrate
from prism_backend.model.transformer import ForestTransformer
from prism_backend.engine.calibration import calibration_requests

from helpers import TINY_ARCHS


def hidden_before_and_after(model_dir, alpha=0.5):
    from prism_backend.text.tokenizer import load_tokenizer

    requests = calibration_requests(load_tokenizer(model_dir))
    forest = build_forest(requests[:3])
    spec, weights = load_model(model_dir)
    before = ForestTransformer(spec, weights).answer_hidden(forest)
    stats = calibrate(ForestTransformer(spec, weights), [build_forest([r]) for r in requests])
    apply_smoothing(spec, weights, stats, alpha)
    after = ForestTransformer(spec, weights).answer_hidden(forest)
    return before, after, stats


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_smoothing_preserves_fp32_function_tiny(tiny_model_dir, arch):
    before, after, stats = hidden_before_and_after(tiny_model_dir(arch))
    torch.testing.assert_close(after, before, rtol=1e-4, atol=1e-4)
    assert all((s["qkv"] > 0).all() for s in stats)


def test_smoothing_preserves_fp32_function_embedded(model_dir):
    before, after, _ = hidden_before_and_after(model_dir)
    torch.testing.assert_close(after, before, rtol=1e-3, atol=1e-3)


def test_smoothed_exact_engine_is_reproducible(fp32_config):
    """Two engines built from the same checkpoint give the same bits (calibration is fixed)."""
    from prism_backend.engine.engine import DecisionEngine
    from prism_backend.serving.determinism import synthetic_requests

    config = fp32_config.replace(precision="exact", smooth_alpha=0.5)
    a, b = DecisionEngine(config), DecisionEngine(config)
    requests = synthetic_requests(a.spec.vocab_size)
    ra, rb = a.score(requests)[0], b.score(requests)[0]
    assert [[s.probabilities.tobytes() for s in r] for r in ra] == [[s.probabilities.tobytes() for s in r] for r in rb]


def test_scales_are_ieee_square_roots_whatever_blas_runs():
    """The smoothing scales of the default alpha are IEEE square roots (numpy's is the CPU's sqrt
    instruction, correctly rounded), not torch's float32 sqrt, whose last bit follows MKL's code
    branch; any other alpha goes through the C library's pow, also in float64."""
    import math

    import numpy as np

    from prism_backend.model.smoothing import _scales

    torch.manual_seed(3)
    ax = torch.rand(4, 576) * 30
    aw = torch.rand(4, 576) * 0.3
    s = _scales(ax, aw, 0.5)
    ieee = np.sqrt(ax.double().numpy()) / np.sqrt(aw.double().numpy())
    assert s.dtype == torch.float32 and s.shape == ax.shape
    assert torch.equal(s, torch.from_numpy(ieee).float().clamp(1e-2, 1e2))
    s = _scales(ax, aw, 0.8)
    pow_ = [[math.pow(x, 0.8) / math.pow(w, 0.2) for x, w in zip(rx, rw)] for rx, rw in zip(ax.tolist(), aw.tolist())]
    assert torch.equal(s, torch.tensor(pow_, dtype=torch.float64).float().clamp(1e-2, 1e2))
