"""Exact segment tokenization: root + trunk + branch ids == ids of the whole rendered prompt."""
import pytest

from prism_backend.errors import RequestError
from prism_backend.model.spec import load_config, load_hf_config, max_context, spec_from_config
from prism_backend.text.prompt import render_user_content
from prism_backend.text.tasks import Task
from prism_backend.text.tokenizer import load_tokenizer

from helpers import SAMPLE_TICKET, TINY_ARCHS, run_snippet

TASKS = [
    Task("team", 1, "Which team should handle this ticket?", ("Billing", "Technical support", "Sales")),
    Task("inline", None, "Is it urgent?", ("Yes", "No")),
    Task("inline", None, "  leading spaces, trailing punctuation?!  ", ("x" * 50, "ümlaut ✓", "12", "-")),
]

AWKWARD_MATERIALS = [
    "Short.",
    "x",
    "trailing spaces   ",
    "   leading spaces",
    "no trailing newline",
    "trailing newline\n",
    "several trailing newlines\n\n\n",
    "windows\r\nline\r\nendings\r\n",
    "tabs\tand\tmore\t",
    "unicode: naïve café – 日本語のテキスト 🚀🚀",
    "emoji at the end 🙂",
    "ends with digits 12345",
    "ends with punctuation...!?",
    "ends with an open quote \"",
    "A) looks like an option\nB) another",
    "<|im_end|> a special token inside the material",
    "Ticket #42: printer on fire\n\nPlease help!!!\n\n\n\n",
    "word " * 1500,
    SAMPLE_TICKET,
    SAMPLE_TICKET.replace("\n", "\r\n"),
]


@pytest.fixture(scope="module")
def prompts(pipeline):
    return pipeline.frontend.prompts


@pytest.fixture(scope="module")
def hf_tokenizer(model_dir):
    """transformers' own tokenizer of the checkpoint: the reference for Prism's torch-free one."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def hf_prompt_ids(hf_tokenizer, system, material, task) -> list[int]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": render_user_content(material, task)}]
    text = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return hf_tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("material", AWKWARD_MATERIALS, ids=range(len(AWKWARD_MATERIALS)))
@pytest.mark.parametrize("system", ["You are terse.", "System prompt ending with spaces   ", "ünïcode ✓"])
def test_segments_concatenate_to_whole_prompt(prompts, hf_tokenizer, material, system):
    """... and the whole prompt is transformers' rendering and tokenization of it (AutoTokenizer's
    apply_chat_template), which Prism's torch-free tokenizer (text/tokenizer.py) must reproduce."""
    enc = prompts.encode(system, material, TASKS)
    for i, task in enumerate(TASKS):
        assert enc.prompt_ids(i) == hf_prompt_ids(hf_tokenizer, system, material.strip(), task)


def test_trunk_is_shared_across_task_sets(prompts):
    """The trunk depends on system + material only, so other requests about the ticket share it."""
    a = prompts.encode("S.", SAMPLE_TICKET, TASKS[:1])
    b = prompts.encode("S.", SAMPLE_TICKET, TASKS[1:])
    assert a.root == b.root and a.trunk == b.trunk
    assert len(a.trunk) > 300  # the material really lives in the trunk
    c = prompts.encode("Another system prompt.", SAMPLE_TICKET, TASKS[:1])
    assert c.root != a.root


def test_root_shared_across_materials(prompts):
    a = prompts.encode("S.", "first ticket", TASKS[:1])
    b = prompts.encode("S.", "second ticket", TASKS[:1])
    assert a.root == b.root and a.trunk != b.trunk


def test_candidates_are_single_letter_tokens(prompts, hf_tokenizer):
    enc = prompts.encode("S.", "m", TASKS)
    assert [len(c) for c in enc.candidates] == [3, 2, 4]
    assert [hf_tokenizer.decode([i]) for i in enc.candidates[2]] == ["A", "B", "C", "D"]


def test_material_longer_than_context_is_rejected(prompts):
    with pytest.raises(RequestError, match="context"):
        prompts.encode("S.", "word " * 9000, TASKS[:1])


def test_empty_material_is_rejected(prompts):
    with pytest.raises(RequestError, match="empty"):
        prompts.encode("S.", " \n\t ", TASKS[:1])


def test_torch_free_tokenizer_falls_back_to_transformers(model_dir, tmp_path, hf_tokenizer):
    """A checkpoint whose chat templates are named (a list in tokenizer_config.json) goes through
    AutoTokenizer; either way the text and ids are transformers' own, one text at a time or many."""
    import json
    import shutil

    for name in ("tokenizer.json", "config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": (model_dir / "chat_template.jinja").read_text()}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    lean, fallback = load_tokenizer(model_dir), load_tokenizer(tmp_path)
    assert (lean.source, fallback.source) == ("tokenizers", "transformers")
    messages = [{"role": "system", "content": "S <|im_end|>"}, {"role": "user", "content": SAMPLE_TICKET}]
    expected = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert lean.render(messages) == fallback.render(messages) == expected
    assert lean.encode(expected) == fallback.encode(expected) == hf_tokenizer(expected, add_special_tokens=False)["input_ids"]
    texts = [expected, SAMPLE_TICKET, "", expected[:57]]  # encode_many: the prompt builder's one call
    assert lean.encode_many(texts) == fallback.encode_many(texts) == [lean.encode(t) for t in texts]
    assert sorted(lean.added_tokens) == sorted(fallback.added_tokens)


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("change", ["as written", "window on", "fields dropped"])
def test_max_context_from_config_json_is_autoconfigs(tiny_model_dir, tmp_path, arch, change):
    """The tokenizer step's context limit (config.json read without transformers) equals the
    engine's (AutoConfig, defaults filled in), with a sliding window switched on or fields missing."""
    import json
    import shutil

    source = tiny_model_dir(arch)
    config = json.loads((source / "config.json").read_text())
    if change == "window on":
        config.update(sliding_window=100, use_sliding_window=True)
    elif change == "fields dropped":
        for key in ("sliding_window", "use_sliding_window", "max_position_embeddings"):
            config.pop(key, None)
    (tmp_path / "config.json").write_text(json.dumps(config))
    expected = spec_from_config(load_hf_config(tmp_path)).max_context
    assert max_context(tmp_path) == expected
    if change == "window on" and arch != "llama3" and arch != "llama_tied":
        assert expected == 100


@pytest.mark.parametrize("arch", TINY_ARCHS)
@pytest.mark.parametrize("change", ["as written", "older RoPE form", "head_dim dropped", "bias dropped"])
def test_config_json_as_written_gives_autoconfigs_spec_and_rotary_table(tiny_model_dir, tmp_path, arch, change):
    """The engine reads config.json without transformers where it names every field Prism reads and
    asks for the original RoPE (load_config); the spec and the RoPE frequencies then equal AutoConfig's
    and transformers' rotary class's, bit for bit. Otherwise it takes AutoConfig's config."""
    import json
    import types

    import torch

    from prism_backend.model.loader import _rotary_class, rotary_frequencies

    config = json.loads((tiny_model_dir(arch) / "config.json").read_text())
    if change == "older RoPE form":  # transformers 4's: rope_theta beside rope_scaling
        params = config.pop("rope_parameters")
        config["rope_theta"] = params.pop("rope_theta")
        config["rope_scaling"] = None if params["rope_type"] == "default" else {"type": params.pop("rope_type"), **params}
    elif change == "head_dim dropped":  # Qwen3's default head_dim (128) is not hidden_size / heads
        config.pop("head_dim", None)
    elif change == "bias dropped":
        config.pop("attention_bias", None)
    (tmp_path / "config.json").write_text(json.dumps(config))

    hf = load_hf_config(tmp_path)
    spec = spec_from_config(hf)
    config_used = load_config(tmp_path)
    as_written = isinstance(config_used, types.SimpleNamespace)
    named = change in ("as written", "older RoPE form") or (change == "head_dim dropped" and arch != "qwen3") \
        or (change == "bias dropped" and arch in ("mistral", "qwen2"))  # the fields whose defaults differ
    assert as_written == (named and arch != "llama3")  # llama3's RoPE variant takes transformers' class
    assert spec_from_config(config_used) == spec
    inv_freq, scaling = rotary_frequencies(config_used, spec_from_config(config_used))
    reference = _rotary_class(spec.model_type)(hf)
    assert inv_freq.dtype == torch.float32 and torch.equal(inv_freq, reference.inv_freq.to(torch.float32))
    assert scaling == float(reference.attention_scaling)


def test_the_embedded_checkpoint_loads_without_transformers():
    """SmolLM2's config.json names every field: its spec and weights load without importing
    transformers (~180 MB and ~2.5 s of the decision stub's start)."""
    loaded = run_snippet(
        "import json, sys\n"
        "from prism_backend.model.loader import load_model\n"
        "from prism_backend.paths import DEFAULT_MODEL_DIR\n"
        "spec, weights = load_model(DEFAULT_MODEL_DIR)\n"
        "print(json.dumps([spec.num_layers, weights.inv_freq.shape[0], sorted(m for m in sys.modules if m.startswith('transformers'))]))")
    assert loaded == [30, 32, []]
