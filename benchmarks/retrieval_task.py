"""The retrieval task of ``benchmarks/retrieval.py``: facts, contexts and scoring.

Pure functions (no model): :func:`make_facts` draws, per family (locker codes, keepers' names,
event dates), a near-duplicate pair and a distinct fact from a seed; :func:`build_context` hides
them at given depths among paragraphs of the bundled texts; :func:`exact_match` and
:func:`wilson` score the answers.

A pair shares its template and differs in one word of its key (the ``blue``/``green`` locker)
and in one detail of its value (two adjacent digits swapped, the surname, the month), so a model
that only roughly attends to "a locker code" answers half of them wrong. The distinct facts
(a safe's combination, a boat's captain, a building's opening date) are plain needles.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

COLOURS = ["blue", "green", "red", "yellow", "white", "black", "orange", "purple", "silver",
           "brown"]
PLACES = [("north", "gate"), ("south", "gate"), ("east", "tower"), ("west", "tower"),
          ("upper", "bridge"), ("lower", "bridge")]
FIRST_NAMES = ["Alma", "Bruno", "Clara", "Dmitri", "Edith", "Felix", "Greta", "Hugo", "Ines",
               "Jonas", "Kira", "Leon", "Mira", "Nils", "Olga", "Pavel"]
SURNAMES = ["Voss", "Brandt", "Carver", "Dunmore", "Ellery", "Fairlie", "Garrow", "Hollis",
            "Ingram", "Kessler", "Lomax", "Marlow", "Norcott", "Pryor", "Quayle", "Rookwood"]
EVENTS = ["spring fair", "harvest fair", "winter market", "summer market", "river festival",
          "lantern festival"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August",
          "September", "October", "November", "December"]
SAFES = ["harbour safe", "vault door", "cellar safe", "strongbox"]  # distinct facts' keys
BOATS = ["ferry", "mail boat", "tugboat", "fishing boat"]
BUILDINGS = ["library", "museum", "town hall", "school"]
FAMILIES = ("code", "name", "date")


@dataclass(frozen=True)
class Fact:
    """One fact: the sentence hidden in the context, its question, and the answer's cue (the
    first words of the answer, given to the model so that it only has to say the value)."""

    family: str
    key: str  # the word that tells the pair apart ("blue")
    sentence: str
    question: str
    cue: str
    answer: str
    twin: bool = False  # one of a near-duplicate pair
    depth: float = 0.0  # where it sits in the context, 0 = start, 1 = end


def _code_facts(rng: random.Random) -> tuple[Fact, Fact, Fact]:
    a, b = rng.sample(COLOURS, 2)
    digits = rng.sample("123456789", 4)  # distinct digits: a swap always changes the code
    i = rng.randrange(3)
    swapped = digits[:i] + [digits[i + 1], digits[i]] + digits[i + 2:]
    other = rng.sample(sorted(set("0123456789") - set(digits)), 4)
    other = other if other[0] != "0" else other[::-1]

    def fact(colour: str, code: list[str]) -> Fact:
        cue = f"The code of the {colour} locker is"
        return Fact("code", colour, f"{cue} {''.join(code)}.",
                    f"What is the code of the {colour} locker?", cue, "".join(code), True)

    safe = rng.choice(SAFES)
    cue = f"The combination of the {safe} is"
    return fact(a, digits), fact(b, swapped), Fact(
        "code", safe, f"{cue} {''.join(other)}.", f"What is the combination of the {safe}?",
        cue, "".join(other))


def _name_facts(rng: random.Random) -> tuple[Fact, Fact, Fact]:
    pair = rng.randrange(len(PLACES) // 2)
    (a, thing), (b, _) = PLACES[2 * pair], PLACES[2 * pair + 1]
    first, other_first = rng.sample(FIRST_NAMES, 2)
    last_a, last_b, last_c = rng.sample(SURNAMES, 3)

    def fact(where: str, last: str) -> Fact:
        cue = f"The keeper of the {where} {thing} is"
        return Fact("name", where, f"{cue} {first} {last}.",
                    f"Who is the keeper of the {where} {thing}?", cue, f"{first} {last}", True)

    boat = rng.choice(BOATS)
    cue = f"The captain of the {boat} is"
    return fact(a, last_a), fact(b, last_b), Fact(
        "name", boat, f"{cue} {other_first} {last_c}.", f"Who is the captain of the {boat}?",
        cue, f"{other_first} {last_c}")


def _date_facts(rng: random.Random) -> tuple[Fact, Fact, Fact]:
    pair = rng.randrange(len(EVENTS) // 2)
    event_a, event_b = EVENTS[2 * pair], EVENTS[2 * pair + 1]
    day, other_day = rng.sample(range(2, 29), 2)
    year, other_year = rng.sample(range(1820, 1991), 2)
    month_a, month_b, month_c = rng.sample(MONTHS, 3)

    def fact(event: str, month: str) -> Fact:
        cue = f"The {event} was held on"
        return Fact("date", event.split()[0], f"{cue} {day} {month} {year}.",
                    f"When was the {event} held?", cue, f"{day} {month} {year}", True)

    building = rng.choice(BUILDINGS)
    cue = f"The new {building} opened on"
    date = f"{other_day} {month_c} {other_year}"
    return fact(event_a, month_a), fact(event_b, month_b), Fact(
        "date", building, f"{cue} {date}.", f"When did the new {building} open?", cue, date)


#: family → its three facts: a near-duplicate pair, then a distinct fact (another template)
FAMILY_FACTS: dict[str, Callable[[random.Random], tuple[Fact, Fact, Fact]]] = {
    "code": _code_facts, "name": _name_facts, "date": _date_facts}


def spread_depths(n: int, low: float = 0.1, high: float = 0.9) -> list[float]:
    """``n`` depths evenly spread over ``[low, high]``."""
    return [low + (high - low) * i / max(n - 1, 1) for i in range(n)]


def make_facts(seed: int, families: tuple[str, ...] = FAMILIES) -> list[Fact]:
    """Per family a near-duplicate pair and a distinct fact, at shuffled, evenly spread
    depths."""
    rng = random.Random(seed)
    facts = [f for family in families for f in FAMILY_FACTS[family](rng)]
    depths = spread_depths(len(facts))
    rng.shuffle(depths)
    return [replace(f, depth=d) for f, d in zip(facts, depths, strict=True)]


def filler_paragraphs(texts: list[str]) -> list[str]:
    """The paragraphs of ``texts`` without HTML comments, headings or rules."""
    out = []
    for text in texts:
        text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            if para and not para.startswith(("#", "---", "*A fictional")):
                out.append(para)
    return out


def build_context(paragraphs: list[str], facts: list[Fact], n_tokens: int,
                  count_tokens: Callable[[str], int], start: int = 0) -> str:
    """About ``n_tokens`` tokens (never more, as ``count_tokens`` adds up) of filler paragraphs,
    cycling from ``start``, with each fact as its own paragraph at its depth."""
    sep = count_tokens("\n\n")  # a paragraph break
    budget = n_tokens - sum(count_tokens(f.sentence) + sep for f in facts)
    chosen: list[str] = []
    used, i = 0, start
    while used < budget:
        para = paragraphs[i % len(paragraphs)]
        cost = count_tokens(para) + sep
        if used + cost > budget:  # cut the last paragraph at a sentence end
            para = _cut(para, budget - used, count_tokens)
            if para:
                chosen.append(para)
            break
        chosen.append(para)
        used, i = used + cost, i + 1
    return place_facts(chosen, facts)


SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def place_facts(paragraphs: list[str], facts: list[Fact]) -> str:
    """``paragraphs`` joined, each fact as its own paragraph at the sentence boundary nearest
    its depth (measured on the result, facts included)."""
    sentences = [(sentence, j == 0) for para in paragraphs
                 for j, sentence in enumerate(SENTENCE_END.split(para))]
    starts, pos = [], 0
    for sentence, _ in sentences:
        starts.append(pos)
        pos += len(sentence) + 1
    starts.append(pos)
    total = pos + sum(len(f.sentence) + 2 for f in facts)
    slots: dict[int, list[Fact]] = {}
    before = 0  # characters of the facts placed ahead of this one
    for fact in sorted(facts, key=lambda f: f.depth):
        target = fact.depth * total - before
        at = min(range(len(starts)), key=lambda i: abs(starts[i] - target))
        slots.setdefault(at, []).append(fact)
        before += len(fact.sentence) + 2
    out: list[str] = []
    for i in range(len(sentences) + 1):
        if i in slots:
            out += [f.sentence for f in slots[i]]
        if i == len(sentences):
            break
        sentence, starts_paragraph = sentences[i]
        if starts_paragraph or i in slots or not out:
            out.append(sentence)
        else:
            out[-1] += " " + sentence
    return "\n\n".join(out)


def _cut(para: str, tokens: int, count_tokens: Callable[[str], int]) -> str:
    """The longest run of whole sentences of ``para`` within ``tokens`` tokens."""
    kept = ""
    for sentence in SENTENCE_END.split(para):
        longer = f"{kept} {sentence}".strip()
        if count_tokens(longer) > tokens:
            break
        kept = longer
    return kept


def fact_depth(context: str, fact: Fact) -> float:
    """Where ``fact`` starts in ``context``, as a fraction of its length."""
    return context.index(fact.sentence) / len(context)


def normalize(text: str) -> list[str]:
    """Lower-case words and numbers, punctuation and whitespace dropped."""
    return re.findall(r"[a-z0-9]+", text.lower())


def exact_match(output: str, answer: str) -> bool:
    """Whether ``output`` starts with ``answer`` (case, whitespace and punctuation ignored)."""
    want = normalize(answer)
    return bool(want) and normalize(output)[:len(want)] == want


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``correct`` successes in ``n`` trials (95% for z=1.96)."""
    if n == 0:
        return 0.0, 1.0
    p = correct / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return max(0.0, centre - half), min(1.0, centre + half)
