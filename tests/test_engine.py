"""The forest engine equals the generic path (Hugging Face, one forward per question, full-vocabulary
softmax renormalised over the candidates) within 1e-5 in fp32, for every supported architecture."""
import json

import numpy as np
import pytest

from prism_backend.config import ConfigError, EngineConfig
from prism_backend.engine.engine import DecisionEngine
from prism_backend.errors import RequestError, run_valid
from prism_backend.engine.forest_builder import build_forest
from prism_backend.forest import EncodedRequest
from prism_backend.model.loader import load_model
from prism_backend.model.spec import CheckpointError
from prism_launcher.reference import HFReference
from prism_backend.serving.pipeline import DecisionPipeline

from helpers import REGISTRY, SAMPLE_TICKET, TINY_ARCHS

TOLERANCE = 1e-5
BIG_TASK = json.dumps({"question": "Which product line is this about?",
                       "options": [f"Product line {i}" for i in range(18)]})  # over the cap of 16
MIXED_BATCH = [
    {"material": SAMPLE_TICKET, "tasks": ["team", "reply_time", "severity"]},  # questions on one ticket
    {"material": "My invoice shows the wrong VAT number. Please fix it.", "tasks": ["team"]},
    {"material": "The app crashes when I upload a photo.", "tasks": ["severity", BIG_TASK]},
    {"material": SAMPLE_TICKET, "tasks": ["severity", "team"]},  # same ticket, another caller
    {"material": "Can I get a discount for 50 seats?", "tasks": ["reply_time"],
     "system": "You route sales leads."},
    {"material": "unrelated", "tasks": ["no_such_task"]},  # fails alone
]


def check_against_reference(pipeline, reference, batch):
    results, stats = pipeline.decide_many(batch, return_prompt_ids=True)
    checked = 0
    for request, result in zip(batch, results):
        if isinstance(result, RequestError):
            continue
        assert len(result) == len(request["tasks"])
        for decision in result:
            ours = np.array(list(decision["probabilities"].values()), dtype=np.float32)
            ref = reference.candidate_probabilities(decision["prompt_ids"], decision["candidate_ids"])
            np.testing.assert_allclose(ours, ref, atol=TOLERANCE, rtol=0)
            checked += 1
    return results, stats, checked


def test_embedded_model_mixed_batch_matches_hf(pipeline, hf_reference):
    results, stats, checked = check_against_reference(pipeline, hf_reference, MIXED_BATCH)
    assert checked == 9
    assert isinstance(results[-1], RequestError) and "no_such_task" in str(results[-1])
    assert results[2][1]["scoring"] == "full_vocabulary" and results[2][0]["scoring"] == "candidates"
    assert stats.fallback_tasks == 1
    # The sample ticket's trunk is computed once for both requests about it.
    assert stats.tokens_computed < stats.tokens_generic / 2


def test_single_request_single_task(pipeline, hf_reference):
    _, stats, checked = check_against_reference(pipeline, hf_reference, [MIXED_BATCH[1]])
    assert checked == 1 and stats.tokens_computed == stats.tokens_generic


def test_fallback_equals_candidate_path(fp32_config):
    """The same 18-option task under a cap of 16 (full vocabulary) and of 26 (candidates only)."""
    material = "The app crashes when I upload a photo."
    low = DecisionPipeline(fp32_config, REGISTRY).decide(material, [BIG_TASK])[0]
    high = DecisionPipeline(fp32_config.replace(max_candidates=26), REGISTRY).decide(material, [BIG_TASK])[0]
    assert low["scoring"] == "full_vocabulary" and high["scoring"] == "candidates"
    np.testing.assert_allclose(list(low["probabilities"].values()), list(high["probabilities"].values()),
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_tiny_architectures_match_hf(tiny_model_dir, arch):
    model_dir = tiny_model_dir(arch)
    pipeline = DecisionPipeline(EngineConfig(model_dir=model_dir, precision="fp32"), REGISTRY)
    reference = HFReference(model_dir)
    batch = [MIXED_BATCH[0], MIXED_BATCH[2], MIXED_BATCH[3], MIXED_BATCH[4]]
    _, _, checked = check_against_reference(pipeline, reference, batch)
    assert checked == 8


def test_forest_shares_prefixes():
    a = EncodedRequest((1, 2), (3, 4, 5), ((6, 7), (8,)), ((10, 11), (10, 11)))
    b = EncodedRequest((1, 2), (3, 4, 5), ((6, 7), (9, 9)), ((10, 11), (10, 11)))  # same ticket
    c = EncodedRequest((1, 2), (30,), ((6,),), ((10, 11),))  # same system prompt, other ticket
    forest = build_forest([a, b, c])
    # root 2 + trunk 3 + branches (2 + 1 + 2) + trunk 1 + branch 1
    assert forest.stats.tokens_computed == 12
    assert forest.stats.tokens_generic == 7 + 6 + 7 + 7 + 4
    assert forest.answers[0][0] == forest.answers[1][0]  # identical branch computed once
    assert forest.positions.tolist() == [0, 1, 2, 3, 4, 5, 6, 5, 5, 6, 2, 3]
    last = forest.segments[-1]  # c's branch sees root, its own trunk and itself only
    assert last.key_rows.tolist() == [0, 1, 10, 11]


def test_isolation_changing_one_branch_changes_no_other_bit(int8_pipeline):
    # the int8 default: batch-invariant by construction on every CPU; fp32's sgemm is MKL's, whose row
    # results follow the pass's row count on some code branches (MKL_CBWR=COMPATIBLE: this test
    # failed there with fp32, 2026-12-06; docs/determinism-and-precision.md)
    pipeline = int8_pipeline
    base = [{"material": SAMPLE_TICKET, "tasks": ["team", "severity"]},
            {"material": "Other ticket.", "tasks": ["reply_time"]}]
    changed = [{"material": SAMPLE_TICKET, "tasks": ["team", '{"question": "Changed?", "options": ["a", "b"]}']},
               {"material": "Other ticket.", "tasks": ["reply_time"]}]
    (r1, s1), (r2, s2) = pipeline.decide_many(base)[0], pipeline.decide_many(changed)[0]
    for d1, d2 in [(r1[0], r2[0]), (s1[0], s2[0])]:
        assert np.array(list(d1["probabilities"].values()), np.float32).tobytes() == \
               np.array(list(d2["probabilities"].values()), np.float32).tobytes()


def test_invalid_token_ids_fail_only_their_request(pipeline):
    engine = pipeline.engine
    good = pipeline.frontend.encode(SAMPLE_TICKET, ["team"])[0]
    bad_id = EncodedRequest((1,), (10**6,), ((5,),), ((49, 50),))
    too_few = EncodedRequest((1,), (2,), ((5,),), ((49,),))
    results, _ = engine.score([bad_id, good, too_few])
    assert isinstance(results[0], RequestError) and "outside the vocabulary" in str(results[0])
    assert isinstance(results[2], RequestError) and "candidates" in str(results[2])
    assert results[1][0].probabilities.shape == (4,)


def test_run_valid_scores_the_rest_and_keeps_errors_in_place():
    bad = RequestError("bad")
    merged, extra = run_valid([1, bad, 3], lambda items: ([i * 10 for i in items], len(items)))
    assert merged == [10, bad, 30] and extra == 2


def test_engines_share_weights_only_when_built_alike(pipeline):
    engine = pipeline.engine  # fp32, no prefix cache
    cached = DecisionEngine(engine.config.replace(prefix_cache_bytes=1 << 20), share_weights_with=engine)
    assert cached.model is engine.model and cached.cache is not None and engine.cache is None
    with pytest.raises(ConfigError, match=r"different \['precision'\]"):
        DecisionEngine(engine.config.replace(precision="int8"), share_weights_with=engine)


def test_loader_names_missing_tensor_and_bad_architecture(tiny_model_dir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama3")
    broken = tmp_path / "broken"
    shutil.copytree(src, broken)
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.layers.1.mlp.down_proj.weight"):
        load_model(broken)

    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="gpt2"):
        load_model(broken)


def test_loader_names_wrong_shape(tiny_model_dir, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "shape"
    shutil.copytree(tiny_model_dir("qwen3"), broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.0.self_attn.k_norm.weight"] = torch.ones(7)
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"k_norm.weight.*\(7,\)"):
        load_model(broken)
