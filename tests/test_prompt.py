"""Exact segment tokenization: root + trunk + branch ids == ids of the whole rendered prompt."""
import pytest

from prism_backend.errors import RequestError
from prism_backend.text.tasks import Task

from helpers import SAMPLE_TICKET

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


@pytest.mark.parametrize("material", AWKWARD_MATERIALS, ids=range(len(AWKWARD_MATERIALS)))
@pytest.mark.parametrize("system", ["You are terse.", "System prompt ending with spaces   ", "ünïcode ✓"])
def test_segments_concatenate_to_whole_prompt(prompts, material, system):
    enc = prompts.encode(system, material, TASKS)
    for i, task in enumerate(TASKS):
        whole = prompts.tokenizer(prompts.render(system, material.strip(), task), add_special_tokens=False)["input_ids"]
        assert enc.prompt_ids(i) == whole


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


def test_candidates_are_single_letter_tokens(prompts):
    enc = prompts.encode("S.", "m", TASKS)
    assert [len(c) for c in enc.candidates] == [3, 2, 4]
    assert [prompts.tokenizer.decode([i]) for i in enc.candidates[2]] == ["A", "B", "C", "D"]


def test_material_longer_than_context_is_rejected(prompts):
    with pytest.raises(RequestError, match="context"):
        prompts.encode("S.", "word " * 9000, TASKS[:1])


def test_empty_material_is_rejected(prompts):
    with pytest.raises(RequestError, match="empty"):
        prompts.encode("S.", " \n\t ", TASKS[:1])
