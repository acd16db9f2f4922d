"""How target-written prompts are steered (`data.self_prompt_categories`): the built-in categories.

Each category gives the target a system prompt while it writes a user turn (what kind of user it
plays) and the first words of that turn. Shared by the recipe check (a bad entry is refused before
any stage starts) and the data stage (`eyas.data.self_prompts`), so it is plain Python.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from eyas.errors import EyasError

NAME = re.compile(r"^[a-z0-9][a-z0-9_-]*$")


@dataclass(frozen=True)
class Steer:
    """What steers one attempt: a system prompt while the target writes, and the user turn's first words."""

    category: str
    system: str
    opener: str = ""


@dataclass(frozen=True)
class Category:
    name: str
    system: str
    openers: tuple[str, ...] = ()

    def steer(self, turn: int) -> Steer:
        """The steer of this category's `turn`-th attempt (openers used in turn)."""
        opener = self.openers[turn % len(self.openers)] if self.openers else ""
        return Steer(self.name, self.system, opener)


def _user(asks: str) -> str:
    return f"You are a user chatting with an AI assistant. {asks} Write only your own message to the assistant."


STEERS: dict[str, Category] = {c.name: c for c in (
    Category("writing", _user("You ask it to write something for you: a poem, a story, an email, a note or a speech."),
             ("Write a", "Can you write", "Help me write", "Draft a")),
    Category("roleplay", _user("You ask it to play a character or a role and talk to you in that role."),
             ("Pretend you are", "Act as", "Let's play a game where you are", "You are a")),
    Category("reasoning", _user("You give it a small logic puzzle or everyday reasoning question to think through."),
             ("If", "Which is", "Why does", "Is it true that")),
    Category("maths", _user("You ask it to solve a maths problem or to explain a calculation."),
             ("What is", "Solve", "Calculate", "How many")),
    Category("coding", _user("You ask for help with programming: writing, explaining or fixing a short piece of code."),
             ("Write a Python function that", "How do I", "What does this code do?\n\n```python\n",
              "Write a SQL query that", "Why does this code not work?\n\n```python\n")),
    Category("extraction", _user("You paste a short text and ask it to pull out names, dates, numbers or facts."),
             ("Extract", "List all the", "From the text below, find")),
    Category("stem", _user("You ask a question about science, nature, technology or medicine."),
             ("How does", "Why do", "Explain", "What is the difference between")),
    Category("humanities", _user("You ask about history, literature, philosophy, art or society."),
             ("Who was", "What was", "Why did", "Explain the history of")),
    Category("translation", _user("You ask it to translate a sentence from one language into another."),
             ("Translate into French:", "Translate into Spanish:", "Translate into German:", "How do you say")),
    Category("summarisation", _user("You paste a text and ask it for a short summary."),
             ("Summarise this text:\n\n", "Can you summarise", "Give me a short summary of", "TL;DR:")),
    Category("qa", _user("You ask a short factual question."),
             ("What is", "Who", "Where is", "How many", "When did")),
    Category("passage_qa", _user("You paste a short passage and ask a question that the passage answers."),
             ("Read the passage and answer the question.\n\nPassage:", "Based on the text below,",
              "According to this paragraph,")),
    Category("chat", _user("You ask for everyday advice or recommendations, as in a casual conversation."),
             ("I", "Any tips for", "What should I", "Can you recommend")),
)}
FOLLOW_UP = Category(
    "follow-up",
    "You are a user chatting with an AI assistant. You have just read its answer. Write one short follow-up "
    "message: ask for a change, more detail, an example or a related question. Write only your own message.",
    ("Can you", "Thanks! Now", "What if", "Why", "Could you make it"),
)


def parse_categories(spec: list) -> list[Category]:
    """`data.self_prompt_categories` -> categories; an EyasError names an entry that is not one."""
    out: list[Category] = []
    for item in spec:
        if isinstance(item, str):
            if item not in STEERS:
                raise EyasError(f"data.self_prompt_categories: unknown category '{item}'; use a built-in one "
                                f"({', '.join(STEERS)}) or give your own as {{{item}: \"system prompt\"}}")
            out.append(STEERS[item])
            continue
        if not (isinstance(item, dict) and len(item) == 1):
            raise EyasError(f"data.self_prompt_categories: entry {item!r} must be a category name or a one-key "
                            "mapping {name: \"system prompt\"} (or {name: {system: ..., openers: [...]}})")
        (name, value), = item.items()
        system, openers = value, []
        if isinstance(value, dict):
            unknown = set(value) - {"system", "openers"}
            system, openers = value.get("system", ""), value.get("openers", [])
            if unknown or not isinstance(openers, list) or not all(isinstance(o, str) and o for o in openers):
                raise EyasError(f"data.self_prompt_categories: category '{name}' takes 'system' (a string) and "
                                "'openers' (a list of non-empty strings) only")
        if not isinstance(system, str) or not (system.strip() or openers):
            raise EyasError(f"data.self_prompt_categories: category '{name}' needs a system prompt (a non-empty "
                            "string) or openers")
        out.append(Category(str(name), system.strip(), tuple(openers)))
    for category in out:
        if not NAME.match(category.name):
            raise EyasError(f"data.self_prompt_categories: category name '{category.name}' must be lower-case "
                            "letters, digits, '_' or '-' (it goes into row ids)")
    names = [c.name for c in out]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise EyasError(f"data.self_prompt_categories: category '{repeated[0]}' is listed twice; list each once")
    return out
