"""Generate kiln's bundled corpus: assets/corpus/kiln_corpus.jsonl (training) and kiln_corpus_validation.jsonl.

Every document is produced here by a small procedural grammar (stories, dialogue, arithmetic,
counting, lists and encyclopedia entries about invented towns). The vocabulary is kept small and
the "world" is consistent (a town always has the same river, population and trade; a cow always
says moo), so a tiny model can visibly learn it within a few dozen steps.

The validation split is held out: the generator goes on past the training documents, and the next ones that
are not also training documents (short arithmetic or counting texts can repeat) form the validation file. The
training file is what the generator's first --target-bytes give, with or without a validation split.

Pure standard library and a fixed seed: re-running gives byte-identical files.

    python scripts/make_corpus.py [--output PATH] [--target-bytes N] [--seed S]
                                  [--validation-output PATH] [--validation-bytes N]
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_OUTPUT = Path(__file__).resolve().parent.parent / "assets" / "corpus" / "kiln_corpus.jsonl"
DEFAULT_VALIDATION_OUTPUT = DEFAULT_OUTPUT.with_name("kiln_corpus_validation.jsonl")
DEFAULT_TARGET_BYTES = 3_000_000
DEFAULT_VALIDATION_BYTES = 300_000  # a tenth of the training set
DEFAULT_SEED = 1234

# ---------------------------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------------------------

# (name, pronoun, possessive)
PEOPLE = [
    ("Ana", "she", "her"),
    ("Tom", "he", "his"),
    ("Mila", "she", "her"),
    ("Ben", "he", "his"),
    ("Lena", "she", "her"),
    ("Sam", "he", "his"),
    ("Nora", "she", "her"),
    ("Leo", "he", "his"),
    ("Ivy", "she", "her"),
    ("Max", "he", "his"),
    ("Rosa", "she", "her"),
    ("Finn", "he", "his"),
    ("Zoe", "she", "her"),
    ("Omar", "he", "his"),
    ("Ella", "she", "her"),
    ("Hugo", "he", "his"),
    ("Lily", "she", "her"),
    ("Jack", "he", "his"),
    ("Maya", "she", "her"),
    ("Theo", "he", "his"),
    ("Iris", "she", "her"),
    ("Noah", "he", "his"),
    ("Ruby", "she", "her"),
    ("Eli", "he", "his"),
    ("Clara", "she", "her"),
    ("Owen", "he", "his"),
    ("Ada", "she", "her"),
    ("Luca", "he", "his"),
    ("June", "she", "her"),
    ("Kai", "he", "his"),
    ("Vera", "she", "her"),
    ("Otto", "he", "his"),
]

# (animal, sound, legs, food, home)
ANIMALS = [
    ("cat", "meow", 4, "fish", "house"),
    ("dog", "woof", 4, "bones", "kennel"),
    ("cow", "moo", 4, "grass", "barn"),
    ("duck", "quack", 2, "bread", "pond"),
    ("hen", "cluck", 2, "corn", "coop"),
    ("sheep", "baa", 4, "grass", "field"),
    ("horse", "neigh", 4, "hay", "stable"),
    ("owl", "hoot", 2, "mice", "tree"),
    ("frog", "croak", 4, "flies", "pond"),
    ("pig", "oink", 4, "apples", "sty"),
    ("goat", "bleat", 4, "leaves", "hill"),
    ("mouse", "squeak", 4, "cheese", "hole"),
    ("bee", "buzz", 6, "nectar", "hive"),
    ("spider", "nothing", 8, "flies", "web"),
    ("crow", "caw", 2, "seeds", "nest"),
    ("lion", "roar", 4, "meat", "den"),
]

OBJECTS = [
    "ball",
    "cup",
    "book",
    "kite",
    "box",
    "hat",
    "key",
    "lamp",
    "map",
    "bell",
    "boat",
    "coin",
    "drum",
    "basket",
    "shoe",
    "spoon",
    "clock",
    "candle",
    "rope",
    "ring",
    "bag",
    "chair",
    "flag",
    "jar",
    "letter",
    "whistle",
    "blanket",
    "bucket",
    "feather",
    "stone",
    "shell",
    "scarf",
]
COLORS = ["red", "blue", "green", "yellow", "white", "black", "brown", "orange", "purple", "gray"]
ADJECTIVES = [
    "small",
    "big",
    "old",
    "new",
    "shiny",
    "heavy",
    "light",
    "soft",
    "round",
    "tiny",
    "strange",
    "pretty",
    "broken",
    "clean",
    "dusty",
    "warm",
]
FEELINGS = ["happy", "sad", "tired", "hungry", "brave", "scared", "proud", "curious", "calm", "excited"]
TRAITS = ["kind", "clever", "quiet", "funny", "careful", "curious", "brave", "gentle", "busy", "helpful"]
SHOPS = ["market", "bakery", "farm", "harbor", "shop"]
PLACES = [
    "garden",
    "kitchen",
    "park",
    "forest",
    "river",
    "school",
    "market",
    "hill",
    "beach",
    "farm",
    "library",
    "bakery",
    "bridge",
    "lake",
    "field",
    "station",
    "harbor",
    "meadow",
]
FOODS = [
    "bread",
    "soup",
    "cheese",
    "apples",
    "honey",
    "rice",
    "eggs",
    "milk",
    "cake",
    "pears",
    "carrots",
    "plums",
    "beans",
    "fish",
    "jam",
]
WEATHER = ["sunny", "rainy", "windy", "snowy", "cloudy", "foggy", "cold", "warm"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
]
SEASONS = ["winter", "spring", "summer", "autumn"]
# (found, looked for, give) style past tense verbs used in story events
ACTIONS = [
    ("painted", "paint"),
    ("washed", "wash"),
    ("fixed", "fix"),
    ("carried", "carry"),
    ("opened", "open"),
    ("cleaned", "clean"),
    ("hid", "hide"),
    ("counted", "count"),
]
GAMES = ["tag", "hide and seek", "catch", "chess", "cards", "marbles", "jump rope"]
# Facts that stay true in every document.
COLOR_FACTS = [
    ("The sky", "blue"),
    ("Grass", "green"),
    ("Snow", "white"),
    ("Coal", "black"),
    ("A ripe lemon", "yellow"),
    ("A ripe tomato", "red"),
    ("An orange", "orange"),
    ("Soil", "brown"),
    ("A plum", "purple"),
    ("Ash", "gray"),
]

# Invented towns, built from syllables so they do not exist anywhere.
TOWN_HEADS = [
    "Brin",
    "Mar",
    "Tol",
    "Ash",
    "Wen",
    "Cal",
    "Dun",
    "Fen",
    "Hal",
    "Kel",
    "Lor",
    "Mos",
    "Nor",
    "Pel",
    "Rav",
    "Sel",
    "Thal",
    "Ul",
    "Var",
    "Wil",
]
TOWN_TAILS = ["dale", "moor", "ford", "wick", "stead", "brook", "haven", "field", "holm", "by", "mere", "gate"]
RIVER_NAMES = ["Amber", "Silver", "Lume", "Tessa", "Orin", "Calla", "Drum", "Wend", "Rusk", "Pell"]
REGIONS = ["north", "south", "east", "west", "center"]
LANDSCAPES = ["valley", "plain", "hills", "coast", "forest", "marshes"]
TRADES = [
    ("cheese", "cheesemakers"),
    ("wool", "weavers"),
    ("pottery", "potters"),
    ("clocks", "clockmakers"),
    ("boats", "boat builders"),
    ("honey", "beekeepers"),
    ("bread", "bakers"),
    ("paper", "papermakers"),
    ("glass", "glassblowers"),
    ("apples", "orchard keepers"),
    ("salt", "salt miners"),
    ("bells", "bell founders"),
]
BUILDINGS = [
    "a stone bridge",
    "an old mill",
    "a tall clock tower",
    "a round library",
    "a red lighthouse",
    "a market hall",
    "a small castle",
    "a wooden church",
]
COUNTRY = "Kilnland"

# ---------------------------------------------------------------------------------------------
# Numbers in words
# ---------------------------------------------------------------------------------------------

ONES = [
    "zero",
    "one",
    "two",
    "three",
    "four",
    "five",
    "six",
    "seven",
    "eight",
    "nine",
    "ten",
    "eleven",
    "twelve",
    "thirteen",
    "fourteen",
    "fifteen",
    "sixteen",
    "seventeen",
    "eighteen",
    "nineteen",
]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety"]
ORDINALS = [
    "zeroth",
    "first",
    "second",
    "third",
    "fourth",
    "fifth",
    "sixth",
    "seventh",
    "eighth",
    "ninth",
    "tenth",
    "eleventh",
    "twelfth",
]


def words(n: int) -> str:
    """Spell a number from 0 to 999,999 in English words ("four hundred and two")."""
    if n < 20:
        return ONES[n]
    if n < 100:
        return TENS[n // 10] + ("" if n % 10 == 0 else "-" + ONES[n % 10])
    if n < 1000:
        rest = n % 100
        return ONES[n // 100] + " hundred" + ("" if rest == 0 else " and " + words(rest))
    rest = n % 1000
    head = words(n // 1000) + " thousand"
    if rest == 0:
        return head
    return head + (" and " if rest < 100 else " ") + words(rest)


def digits(n: int) -> str:
    """Write a number with thousands separators (4,200)."""
    return f"{n:,}"


# ---------------------------------------------------------------------------------------------
# A small consistent world
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Town:
    name: str
    region: str
    landscape: str
    river: str
    population: int
    founded: int
    trade: tuple[str, str]
    building: str
    market_day: str
    mayor: str


def build_towns(rng: random.Random, count: int = 48) -> list[Town]:
    """Invent `count` towns with fixed facts that every document about them repeats."""
    names: list[str] = []
    while len(names) < count:
        name = rng.choice(TOWN_HEADS) + rng.choice(TOWN_TAILS)
        if name not in names:
            names.append(name)
    towns = []
    for name in names:
        towns.append(
            Town(
                name=name,
                region=rng.choice(REGIONS),
                landscape=rng.choice(LANDSCAPES),
                river=rng.choice(RIVER_NAMES),
                population=rng.randrange(300, 60000, 10),
                founded=rng.randrange(1100, 1900),
                trade=rng.choice(TRADES),
                building=rng.choice(BUILDINGS),
                market_day=rng.choice(DAYS),
                mayor=rng.choice(PEOPLE)[0] + " " + rng.choice(TOWN_HEADS) + rng.choice(["er", "son", "ley"]),
            )
        )
    return towns


def distance(a: Town, b: Town) -> int:
    """A fixed, symmetric distance in kilometers between two towns."""
    lo, hi = sorted((a.name, b.name))
    return 5 + sum(ord(c) for c in lo + hi) * 7 % 180


def a_an(word: str) -> str:
    """Pick the English article for `word`."""
    return ("an " if word[0] in "aeiou" else "a ") + word


def sentence_join(parts: list[str]) -> str:
    """Join sentences into one paragraph."""
    return " ".join(p.strip() for p in parts if p.strip())


def join_list(items: list[str]) -> str:
    """ "a, b and c" style list."""
    if len(items) == 1:
        return items[0]
    return ", ".join(items[:-1]) + " and " + items[-1]


# ---------------------------------------------------------------------------------------------
# Document generators; each returns one document's text.
# ---------------------------------------------------------------------------------------------


class Corpus:
    """Holds the random state and the fixed world; each method writes one kind of document."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.towns = build_towns(random.Random(seed + 1))

    # -- helpers -------------------------------------------------------------------------------
    def person(self) -> tuple[str, str, str]:
        return self.rng.choice(PEOPLE)

    def two_people(self) -> tuple[tuple[str, str, str], tuple[str, str, str]]:
        a, b = self.rng.sample(PEOPLE, 2)
        return a, b

    def thing(self) -> str:
        r = self.rng.random()
        obj = self.rng.choice(OBJECTS)
        if r < 0.4:
            return f"{self.rng.choice(COLORS)} {obj}"
        if r < 0.7:
            return f"{self.rng.choice(ADJECTIVES)} {obj}"
        return f"{self.rng.choice(ADJECTIVES)} {self.rng.choice(COLORS)} {obj}"

    # -- stories -------------------------------------------------------------------------------
    def story(self) -> str:
        rng = self.rng
        (name, he, his), (friend, fhe, _) = self.two_people()
        town = rng.choice(self.towns)
        thing = self.thing()
        place, place2 = rng.sample(PLACES, 2)
        # Only animals that make a sound: the story quotes it.
        animal, sound, _, food, _ = rng.choice([a for a in ANIMALS if a[1] != "nothing"])
        opening = rng.choice(
            [
                f"Once upon a time, there was a {rng.choice(TRAITS)} child named {name}.",
                f"{name} lived in {town.name}, a town on the {town.river} River.",
                f"There was once a {rng.choice(TRAITS)} {'girl' if he == 'she' else 'boy'} called {name}.",
                f"In the town of {town.name}, there lived a child named {name}.",
            ]
        )
        parts = [opening]
        if rng.random() < 0.6:
            parts.append(
                f"{he.capitalize()} had {a_an(animal)} that liked to eat {food}. "
                f'Every morning the {animal} said "{sound}".'
            )
        day = rng.choice(DAYS)
        parts.append(
            rng.choice(
                [
                    f"One {rng.choice(WEATHER)} {day}, {name} went to the {place}.",
                    f"On {day} morning, {name} walked to the {place}.",
                    f"It was a {rng.choice(WEATHER)} day in {rng.choice(MONTHS)}, and {name} was at the {place}.",
                ]
            )
        )
        parts.append(
            rng.choice(
                [
                    f"There {he} found {a_an(thing)}.",
                    f"Under a bench, {he} saw {a_an(thing)}.",
                    f"Near the gate, {name} found {a_an(thing)}.",
                ]
            )
        )
        event = rng.randrange(4)
        if event == 0:  # lost and found
            parts += [
                f"{name} put the {thing} in {his} bag, but on the way home the bag had a hole.",
                f"When {he} got home, the {thing} was gone. {name} was {rng.choice(['sad', 'worried'])}.",
                f"{he.capitalize()} asked {friend} for help. Together they walked back to the {place}.",
                f'They looked by the {place2} and under the trees. At last {friend} shouted, "I found it!"',
                f'{name} was happy again. "Thank you, {friend}," {he} said.',
            ]
        elif event == 1:  # gift
            verb, _ = rng.choice(ACTIONS)
            parts += [
                f"{he.capitalize()} took the {thing} home and {verb} it.",
                f"The next day was {friend}'s birthday, so {name} gave the {thing} to {friend}.",
                f'{friend} smiled. "This is the best gift," {fhe} said.',
                f"After that, {name} and {friend} played {rng.choice(GAMES)} until it was dark.",
            ]
        elif event == 2:  # trip to another town
            other = rng.choice([t for t in self.towns if t is not town])
            km = distance(town, other)
            parts += [
                f"{name} wanted to show the {thing} to {friend}, who lived in {other.name}.",
                f"{other.name} is {words(km)} kilometers from {town.name}, so {name} took the train.",
                f"In {other.name}, {friend} was busy with the {other.trade[0]} market.",
                f'"Look at this," said {name}. {friend} looked at the {thing} for a long time.',
                f'"It is {rng.choice(ADJECTIVES)}," {fhe} said, "but I like it."',
                f"In the evening {name} went back home and told {his} family about the trip.",
            ]
        else:  # animal problem
            parts += [
                f"Just then, {a_an(animal)} ran past and took the {thing}!",
                f'"Stop!" cried {name}. The {animal} said "{sound}" and ran to the {place2}.',
                f"{name} followed it. The {animal} was hungry, so {name} gave it some {food}.",
                f"The {animal} dropped the {thing} and ate the {food}.",
                f"{name} laughed and carried the {thing} home.",
            ]
        if rng.random() < 0.5:
            parts.append(
                rng.choice(
                    [
                        f"That night, {name} felt {rng.choice(FEELINGS)} and slept well.",
                        "The end.",
                        f"{name} never forgot that day.",
                        f"From then on, {name} and {friend} were best friends.",
                    ]
                )
            )
        return sentence_join(parts)

    # -- dialogue ------------------------------------------------------------------------------
    def dialogue(self) -> str:
        rng = self.rng
        (a, _, _), (b, _, _) = self.two_people()
        place = rng.choice(SHOPS)
        food = rng.choice(FOODS)
        opening = rng.randrange(3)
        if opening == 0:
            lines = [
                f"{a}: Good {rng.choice(['morning', 'afternoon', 'evening'])}, {b}!",
                f"{b}: Hello, {a}. Where are you going?",
                f"{a}: I am going to the {place} to buy some {food}.",
            ]
        elif opening == 1:
            lines = [
                f"{a}: {b}, are you busy?",
                f"{b}: Not really. What do you need?",
                f"{a}: I need {food} from the {place}. Will you come with me?",
                f"{b}: Yes, I will come.",
            ]
        else:
            lines = [f"{b}: Hi, {a}. What are you doing?", f"{a}: I am making a list. We need {food} from the {place}."]
        n = rng.randrange(2, 13)
        price = rng.randrange(1, 10)
        lines.append(f"{b}: How many will you buy?")
        lines.append(f"{a}: {words(n).capitalize()}. Each one costs {words(price)} coins.")
        lines.append(
            f"{b}: Then you need {words(n * price)} coins, because {words(n)} times "
            f"{words(price)} is {words(n * price)}."
        )
        thanks = rng.choice(["Thank you!", "I almost forgot.", "Good thinking."])
        lines.append(f"{a}: You are right. {thanks}")
        for _ in range(rng.randrange(1, 4)):
            kind = rng.randrange(4)
            if kind == 0:
                w = rng.choice(WEATHER)
                lines.append(f"{b}: Do you think it will be {w} tomorrow?")
                lines.append(f"{a}: {rng.choice(['Yes', 'No', 'Maybe'])}. Today it is {rng.choice(WEATHER)}.")
            elif kind == 1:
                animal, sound, legs, _, home = rng.choice(ANIMALS)
                lines.append(f"{b}: What does the {animal} say?")
                lines.append(f"{a}: The {animal} says {sound}. It has {words(legs)} legs and lives in a {home}.")
            elif kind == 2:
                game = rng.choice(GAMES)
                lines.append(f"{b}: Do you want to play {game} later?")
                lines.append(f"{a}: Yes! Let us meet at the {rng.choice(PLACES)} on {rng.choice(DAYS)}.")
            else:
                town = rng.choice(self.towns)
                lines.append(f"{b}: Have you ever been to {town.name}?")
                lines.append(f"{a}: Yes. It is on the {town.river} River and it is famous for its {town.trade[0]}.")
        lines.append(f"{b}: {rng.choice(['Goodbye', 'See you soon', 'Have a nice day'])}, {a}.")
        header = rng.choice(["", f"A conversation at the {place}.\n\n", "Dialogue\n\n"])
        return header + "\n".join(lines)

    # -- arithmetic ----------------------------------------------------------------------------
    def arithmetic(self) -> str:
        rng = self.rng
        style = rng.randrange(4)
        out: list[str] = []
        if style == 3:  # a times table, fully consistent
            k = rng.randrange(2, 13)
            out.append(f"The {words(k)} times table.")
            for i in range(1, 13):
                out.append(f"{words(i).capitalize()} times {words(k)} is {words(i * k)}. {i} x {k} = {i * k}.")
            return "\n".join(out)
        out.append(rng.choice(["Arithmetic facts.", "Numbers practice.", "Let us do some sums.", "Math lesson."]))
        for _ in range(rng.randrange(8, 22)):
            op = rng.randrange(4)
            if op == 0:
                x, y = rng.randrange(0, 50), rng.randrange(0, 50)
                w, d, z = "plus", "+", x + y
            elif op == 1:
                x = rng.randrange(0, 60)
                y = rng.randrange(0, x + 1)
                w, d, z = "minus", "-", x - y
            elif op == 2:
                x, y = rng.randrange(0, 13), rng.randrange(0, 13)
                w, d, z = "times", "x", x * y
            else:
                y = rng.randrange(1, 13)
                z = rng.randrange(0, 13)
                x = y * z
                w, d = "divided by", "/"
            if style == 0:
                out.append(f"{words(x).capitalize()} {w} {words(y)} is {words(z)}. {x} {d} {y} = {z}.")
            elif style == 1:
                out.append(f"Question: What is {words(x)} {w} {words(y)}? Answer: {words(z)} ({z}).")
            else:
                out.append(f"{x} {d} {y} = {z}")
        return "\n".join(out)

    # -- counting ------------------------------------------------------------------------------
    def counting(self) -> str:
        rng = self.rng
        paras = []
        for _ in range(rng.randrange(2, 5)):
            kind = rng.randrange(5)
            if kind == 0:
                a = rng.randrange(0, 80)
                b = a + rng.randrange(8, 30)
                paras.append(
                    f"Counting from {words(a)} to {words(b)}: " + ", ".join(words(i) for i in range(a, b + 1)) + "."
                )
            elif kind == 1:
                step = rng.randrange(2, 11)
                start = step * rng.randrange(0, 5)
                seq = [start + step * i for i in range(rng.randrange(8, 16))]
                paras.append(f"Counting by {words(step)}s: " + ", ".join(map(str, seq)) + ".")
            elif kind == 2:
                a = rng.randrange(10, 40)
                paras.append(
                    f"Counting backwards from {words(a)}: "
                    + ", ".join(words(i) for i in range(a, -1, -1))
                    + ". Blast off!"
                )
            elif kind == 3:
                a = rng.randrange(0, 900)
                n = rng.randrange(8, 20)
                paras.append("Numbers: " + ", ".join(f"{i} is {words(i)}" for i in range(a, a + n)) + ".")
            else:
                start = rng.randrange(7)
                n = rng.randrange(3, 8)
                seq = [DAYS[(start + i) % 7] for i in range(n)]
                paras.append(f"After {seq[0]} comes {seq[1]}. The days in order are: " + ", ".join(seq) + ".")
        return "\n\n".join(paras)

    # -- lists ---------------------------------------------------------------------------------
    def lists(self) -> str:
        rng = self.rng
        name = self.person()[0]
        kind = rng.randrange(4)
        if kind == 0:
            items = rng.sample(FOODS, rng.randrange(4, 9))
            lines = [f"Shopping list for {name}:"]
            lines += [f"- {words(rng.randrange(1, 13))} {it}" for it in items]
            lines.append(f"{name} will go to the market on {rng.choice(DAYS)}.")
            return "\n".join(lines)
        if kind == 1:
            place = rng.choice(PLACES)
            items = rng.sample(OBJECTS, rng.randrange(4, 10))
            lines = [f"Things {name} saw at the {place}:"]
            lines += [f"{i + 1}. {a_an(rng.choice(COLORS) + ' ' + it)}" for i, it in enumerate(items)]
            lines.append(f"That is {words(len(items))} things in all.")
            return "\n".join(lines)
        if kind == 2:
            facts = rng.sample(COLOR_FACTS, rng.randrange(4, 9))
            lines = ["Colors of things."]
            lines += [f"{subj} is {color}." for subj, color in facts]
            animals = rng.sample(ANIMALS, rng.randrange(3, 7))
            lines.append("Animals and their sounds.")
            lines += [f"The {a} says {s}." if s != "nothing" else f"The {a} makes no sound." for a, s, *_ in animals]
            return "\n".join(lines)
        month = rng.randrange(12)
        lines = [f"{name}'s diary for {MONTHS[month]}."]
        for day in sorted(rng.sample(range(1, 29), rng.randrange(4, 9))):
            lines.append(f"{MONTHS[month]} {day}: {rng.choice(self._diary_entries())}")
        lines.append(f"The season was {SEASONS[(month + 1) % 12 // 3]}.")
        return "\n".join(lines)

    def _diary_entries(self) -> list[str]:
        rng = self.rng
        return [
            f"The weather was {rng.choice(WEATHER)}. I stayed at home and read a book.",
            f"I went to the {rng.choice(PLACES)} with {rng.choice(PEOPLE)[0]}.",
            f"We ate {rng.choice(FOODS)} and {rng.choice(FOODS)} for dinner.",
            f"I found {a_an(self.thing())} near the {rng.choice(PLACES)}.",
            f"We played {rng.choice(GAMES)}. I won {words(rng.randrange(2, 10))} times.",
            f"I felt {rng.choice(FEELINGS)} all day.",
            f"My {rng.choice(ANIMALS)[0]} was sick, so I gave it some water.",
            f"I helped my friend {rng.choice(ACTIONS)[1]} a {rng.choice(OBJECTS)}.",
        ]

    # -- encyclopedia --------------------------------------------------------------------------
    def encyclopedia(self) -> str:
        rng = self.rng
        t = rng.choice(self.towns)
        trade, makers = t.trade
        others = rng.sample([o for o in self.towns if o is not t], 2)
        facts = [
            f"{t.name} is a town in the {t.region} of {COUNTRY}, in the {t.landscape}.",
            f"It lies on the {t.river} River.",
            f"The town was founded in the year {t.founded}.",
            f"{t.name} has a population of {digits(t.population)} people ({words(t.population)}).",
            f"It is known for its {trade}, and many of its people are {makers}.",
            f"The town has {t.building}.",
            f"The market is held every {t.market_day}.",
            f"The mayor of {t.name} is {t.mayor}.",
        ]
        extra = [f"{t.name} is {distance(t, o)} kilometers from {o.name}." for o in others]
        bigger = max(t, others[0], key=lambda x: x.population)
        extra.append(f"{bigger.name} is bigger than {(others[0] if bigger is t else t).name}.")
        body = facts[:2] + rng.sample(facts[2:], rng.randrange(3, len(facts) - 1)) + extra
        style = rng.randrange(3)
        if style == 0:
            return f"{t.name}\n\n" + sentence_join(body)
        if style == 1:
            rows = [
                f"Name: {t.name}",
                f"Country: {COUNTRY}",
                f"Region: {t.region}",
                f"River: {t.river}",
                f"Founded: {t.founded}",
                f"Population: {digits(t.population)}",
                f"Known for: {trade}",
                f"Market day: {t.market_day}",
                f"Mayor: {t.mayor}",
            ]
            return f"{t.name} (town)\n" + "\n".join(rows) + "\n\n" + sentence_join(body[:4])
        q = [
            (f"Which river is {t.name} on?", f"{t.name} is on the {t.river} River."),
            (f"How many people live in {t.name}?", f"{digits(t.population)} people live in {t.name}."),
            (f"When was {t.name} founded?", f"{t.name} was founded in {t.founded}."),
            (f"What is {t.name} known for?", f"{t.name} is known for its {trade}."),
            (f"When is the market in {t.name}?", f"The market is on {t.market_day}."),
            (f"Who is the mayor of {t.name}?", f"The mayor is {t.mayor}."),
        ]
        picked = rng.sample(q, rng.randrange(3, len(q) + 1))
        return f"Questions about {t.name}\n\n" + "\n".join(f"Q: {a}\nA: {b}" for a, b in picked)

    def region_overview(self) -> str:
        rng = self.rng
        region = rng.choice(REGIONS)
        towns = [t for t in self.towns if t.region == region]
        towns.sort(key=lambda t: -t.population)
        parts = [f"The {region} of {COUNTRY} has {words(len(towns))} towns."]
        parts.append(f"The largest is {towns[0].name}, with {digits(towns[0].population)} people.")
        if len(towns) > 1:
            parts.append(f"The smallest is {towns[-1].name}, with {digits(towns[-1].population)} people.")
        lines = [f"{i + 1}. {t.name}: {digits(t.population)}, on the {t.river} River" for i, t in enumerate(towns)]
        return sentence_join(parts) + "\n\nTowns by population:\n" + "\n".join(lines)

    # -- animal / nature facts -----------------------------------------------------------------
    def nature(self) -> str:
        rng = self.rng
        parts = []
        for animal, sound, legs, food, home in rng.sample(ANIMALS, rng.randrange(2, 5)):
            s = [
                f"The {animal} is an animal with {words(legs)} legs.",
                f"It eats {food} and lives in a {home}."
                if animal != "bee"
                else f"It drinks {food} and lives in a {home}.",
                f"The {animal} says {sound}." if sound != "nothing" else f"The {animal} makes no sound.",
            ]
            n = rng.randrange(2, 10)
            s.append(f"{words(n).capitalize()} {animal}s have {words(n * legs)} legs in all.")
            # Keep the defining sentence first; shuffle the rest so the order is not fixed.
            rest = s[1:]
            rng.shuffle(rest)
            parts.append(" ".join([s[0], *rest]))
        m = rng.randrange(12)
        parts.append(
            f"{MONTHS[m]} is the {ORDINALS[m + 1]} month of the year. "
            f"It comes after {MONTHS[m - 1]} and before {MONTHS[(m + 1) % 12]}."
        )
        return "\n\n".join(parts)


def generate(seed: int, target_bytes: int, corpus: Corpus | None = None) -> list[str]:
    """Generate documents until their JSONL size reaches `target_bytes` (continuing `corpus`'s stream if given)."""
    corpus = Corpus(seed) if corpus is None else corpus
    kinds: list[tuple[Callable[[], str], int]] = [
        (corpus.story, 30),
        (corpus.dialogue, 14),
        (corpus.arithmetic, 12),
        (corpus.counting, 8),
        (corpus.lists, 10),
        (corpus.encyclopedia, 14),
        (corpus.region_overview, 2),
        (corpus.nature, 10),
    ]
    makers = [k for k, _ in kinds]
    weights = [w for _, w in kinds]
    docs: list[str] = []
    size = 0
    while size < target_bytes:
        maker = corpus.rng.choices(makers, weights)[0]
        text = maker()
        # Glue short documents together so each is a few hundred characters at least.
        while len(text) < 300:
            text += "\n\n" + corpus.rng.choices(makers, weights)[0]()
        docs.append(text)
        size += len(json.dumps({"text": text})) + 1
    return docs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DEFAULT_OUTPUT)
    parser.add_argument("--target-bytes", type=int, default=DEFAULT_TARGET_BYTES)
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED)
    parser.add_argument("--validation-output", type=Path, default=DEFAULT_VALIDATION_OUTPUT)
    parser.add_argument("--validation-bytes", type=int, default=DEFAULT_VALIDATION_BYTES)
    args = parser.parse_args()
    corpus = Corpus(args.seed)
    docs = generate(args.seed, args.target_bytes, corpus)
    seen = set(docs)
    held_out = [text for text in generate(args.seed, args.validation_bytes, corpus) if text not in seen]
    for path, texts in ((args.output, docs), (args.validation_output, held_out)):
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(json.dumps({"text": text}) + "\n" for text in texts)
        print(f"wrote {len(texts)} documents, {path.stat().st_size:,} bytes to {path}")


if __name__ == "__main__":
    main()
