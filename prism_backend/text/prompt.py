"""Prompt rendering and exact segment tokenization.

The prompt is the model's own chat template:
    system message = the system prompt
    user message   = material + "\\n\\n" + question + "\\n" + "A) option" lines
    assistant turn = opened by the template's generation prompt; the answer is one letter token.

It is cut into three segments whose token ids, concatenated, equal the ids of the whole rendered
prompt (the invariant the forest relies on):
    root   = everything up to the last special token before the user content (system prompt only),
    trunk  = the material, up to where every question's tokenization still agrees,
    branch = the rest: separator, question, options and the generation prompt.
Boundaries sit where tokenization cannot merge across them: after a special token (added tokens
are split off before BPE), and at the longest common prefix of the material-only tokenization and
each full prompt, so the invariant holds for any text.
"""
from __future__ import annotations

from ..errors import RequestError
from ..forest import EncodedRequest
from .tasks import Task
from .tokenizer import ChatTokenizer


def common_prefix_length(a, b) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def render_user_content(material: str, task: Task) -> str:
    options = "\n".join(f"{letter}) {option}" for letter, option in zip(task.letters, task.options))
    return f"{material}\n\n{task.question}\n{options}"


def render_prompt(tokenizer: ChatTokenizer, system: str, material: str, task: Task) -> str:
    """The whole prompt of one question, as text, through the model's own chat template."""
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": render_user_content(material, task)},
    ]
    return tokenizer.render(messages)


class PromptBuilder:
    def __init__(self, tokenizer: ChatTokenizer, max_context: int, max_letters: int = 26):
        self.tokenizer = tokenizer
        self.max_context = max_context
        self._added_tokens = sorted(set(tokenizer.added_tokens), key=len)
        self.letter_ids = self._letter_token_ids(max_letters)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def render(self, system: str, material: str, task: Task) -> str:
        return render_prompt(self.tokenizer, system, material, task)

    def _letter_token_ids(self, count: int) -> tuple[int, ...]:
        """The token of each answer letter as it follows the generation prompt; must be one token."""
        probe = Task("probe", None, "Question?", tuple(f"option {i}" for i in range(count)))
        prompt = self.render("System.", "Material.", probe)
        prompt_ids = self._encode(prompt)
        ids = []
        for letter in probe.letters:
            full = self._encode(prompt + letter)
            if full[: len(prompt_ids)] != prompt_ids or len(full) != len(prompt_ids) + 1:
                raise ValueError(
                    f"answer letter {letter!r} is not a single token after the chat template's "
                    "generation prompt; this tokenizer cannot be used for one-token decisions"
                )
            ids.append(full[-1])
        return tuple(ids)

    def _root_end(self, rendered: str, content_start: int) -> int:
        """End of the last added (special) token before the user content: a safe cut point."""
        head = rendered[:content_start]
        end = 0
        for token in self._added_tokens:
            pos = head.rfind(token)
            if pos >= 0:
                end = max(end, pos + len(token))
        return end

    def encode(self, system: str, material: str, tasks: list[Task]) -> EncodedRequest:
        """Segment token ids for one request. `material` is used with outer whitespace stripped."""
        material = material.strip()
        if not material:
            raise RequestError("'material' is empty")
        if not tasks:
            raise RequestError("no tasks: give at least one element in 'tasks'")

        renders = [self.render(system, material, task) for task in tasks]
        first = renders[0]
        content_start = first.find(render_user_content(material, tasks[0]))
        if content_start < 0:
            raise ValueError("the chat template changed the user content; cannot place the material")
        material_end = content_start + len(material)
        root_end = self._root_end(first, content_start)

        # every prompt, the material's end and the system prompt's, in one call
        *fulls, trunk_guess, root = self.tokenizer.encode_many([*renders, first[:material_end], first[:root_end]])
        for task, ids in zip(tasks, fulls):
            if len(ids) + 1 > self.max_context:
                raise RequestError(
                    f"prompt for task {task.name!r} is {len(ids)} tokens; the model's context is "
                    f"{self.max_context} tokens (material too long)"
                )
        root_len = min([common_prefix_length(root, ids) for ids in fulls])
        trunk_len = min([common_prefix_length(trunk_guess, ids) for ids in fulls])
        root_len = min(root_len, trunk_len)

        base = fulls[0]
        root_ids = tuple(base[:root_len])
        trunk_ids = tuple(base[root_len:trunk_len])
        branches = tuple(tuple(ids[trunk_len:]) for ids in fulls)
        candidates = tuple(self.letter_ids[: len(task.options)] for task in tasks)
        return EncodedRequest(root_ids, trunk_ids, branches, candidates)
