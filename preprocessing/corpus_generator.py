"""Deterministic generator for the shipped sample corpus (``sample_corpus/stories.jsonl``).

Nothing can be downloaded, so the project writes its own small English-like corpus:
short stories, lessons, dialogues and letters built from templates over a fixed
world (invented countries and their capitals, people with pets and jobs, colors of
things, animal sounds, small arithmetic). Facts never contradict each other across
documents, so a tiny GPT can learn them and a zero-shot multiple-choice task can be
generated from the same tables (see ``multiple_choice_items``).

    python -m preprocessing.corpus_generator --output preprocessing/sample_corpus/stories.jsonl --seed 0

The fact tables are constants, independent of ``--seed``; the seed only changes
which documents are written. Same seed, same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_DOCUMENTS = 2250


@dataclass(frozen=True)
class Country:
    name: str
    capital: str
    flag: tuple[str, str]
    export: str
    animal: str
    climate: str


@dataclass(frozen=True)
class Character:
    name: str
    pronoun: str  # "she" or "he"
    job: str
    pet: str
    pet_name: str
    home: str  # a country name; the character lives in its capital
    favorite_color: str
    favorite_food: str

    @property
    def subject(self) -> str:
        return self.pronoun

    @property
    def object(self) -> str:
        return "her" if self.pronoun == "she" else "him"

    @property
    def possessive(self) -> str:
        return "her" if self.pronoun == "she" else "his"


# ---------------------------------------------------------------------------
# The world. Every document agrees with these tables.
# ---------------------------------------------------------------------------

COUNTRIES: tuple[Country, ...] = (
    Country("Valdoria", "Mirelle", ("green", "white"), "apples", "fox", "rainy"),
    Country("Kestrava", "Dunmoor", ("red", "gold"), "wool", "bear", "snowy"),
    Country("Ostrelia", "Pellan", ("blue", "yellow"), "salt", "seal", "windy"),
    Country("Brennick", "Harrowby", ("black", "orange"), "copper", "wolf", "cold"),
    Country("Zanthor", "Quillon", ("purple", "white"), "silk", "tiger", "hot"),
    Country("Luvania", "Amberly", ("pink", "green"), "honey", "deer", "sunny"),
    Country("Tessaly", "Corran", ("red", "white"), "cheese", "goat", "windy"),
    Country("Morvena", "Estrel", ("blue", "white"), "fish", "whale", "foggy"),
    Country("Pyrenth", "Galdric", ("orange", "brown"), "pottery", "lizard", "dry"),
    Country("Vantia", "Rellis", ("yellow", "black"), "coffee", "parrot", "hot"),
    Country("Eskarra", "Tovin", ("white", "grey"), "furs", "owl", "snowy"),
    Country("Norvale", "Brightwater", ("green", "blue"), "timber", "moose", "rainy"),
    Country("Sulvane", "Orrin", ("gold", "purple"), "spices", "camel", "dry"),
    Country("Drumland", "Castellan", ("red", "black"), "iron", "horse", "cloudy"),
    Country("Iverra", "Lune", ("silver", "blue"), "pearls", "dolphin", "warm"),
    Country("Calmora", "Verrin", ("orange", "white"), "oranges", "crab", "sunny"),
    Country("Hollin", "Ashby", ("brown", "green"), "potatoes", "badger", "rainy"),
    Country("Quorra", "Fennick", ("yellow", "green"), "tea", "panda", "misty"),
    Country("Rusk", "Maple Harbor", ("red", "yellow"), "maple syrup", "beaver", "cold"),
    Country("Taldor", "Windhollow", ("grey", "red"), "marble", "eagle", "windy"),
)

CHARACTERS: tuple[Character, ...] = (
    Character("Mira", "she", "baker", "dog", "Biscuit", "Valdoria", "green", "porridge"),
    Character("Ben", "he", "farmer", "cat", "Pepper", "Kestrava", "red", "apple pie"),
    Character("Lila", "she", "teacher", "duck", "Clover", "Ostrelia", "blue", "soup"),
    Character("Tom", "he", "sailor", "goat", "Rusty", "Morvena", "yellow", "fish stew"),
    Character("Nora", "she", "doctor", "owl", "Pip", "Zanthor", "purple", "rice"),
    Character("Sam", "he", "painter", "horse", "Sunny", "Luvania", "orange", "pancakes"),
    Character("Ivy", "she", "gardener", "frog", "Pebble", "Tessaly", "pink", "salad"),
    Character("Leo", "he", "builder", "pig", "Ziggy", "Brennick", "brown", "bread"),
    Character("Ada", "she", "tailor", "sheep", "Maple", "Pyrenth", "white", "noodles"),
    Character("Max", "he", "fisher", "mouse", "Button", "Vantia", "black", "cheese"),
    Character("Ruby", "she", "potter", "cat", "Mittens", "Eskarra", "red", "carrot cake"),
    Character("Finn", "he", "miller", "dog", "Rex", "Norvale", "green", "sausages"),
    Character("Zoe", "she", "librarian", "horse", "Star", "Sulvane", "gold", "dates"),
    Character("Hugo", "he", "carpenter", "duck", "Waddles", "Drumland", "grey", "beans"),
    Character("Ella", "she", "musician", "dog", "Bingo", "Iverra", "silver", "grapes"),
    Character("Omar", "he", "cook", "goat", "Patch", "Calmora", "orange", "omelettes"),
    Character("Tara", "she", "farmer", "pig", "Truffle", "Hollin", "brown", "potatoes"),
    Character("Jack", "he", "teacher", "owl", "Hoot", "Quorra", "yellow", "dumplings"),
    Character("Maya", "she", "sailor", "cat", "Shadow", "Rusk", "blue", "waffles"),
    Character("Eli", "he", "doctor", "frog", "Lily", "Taldor", "green", "lentils"),
    Character("Rosa", "she", "builder", "sheep", "Fluffy", "Valdoria", "pink", "plums"),
    Character("Ned", "he", "baker", "mouse", "Crumb", "Kestrava", "white", "muffins"),
    Character("Gwen", "she", "painter", "duck", "Puddle", "Morvena", "purple", "berries"),
    Character("Otto", "he", "gardener", "dog", "Scout", "Zanthor", "red", "mangoes"),
    Character("Lucy", "she", "fisher", "horse", "Blaze", "Tessaly", "orange", "crackers"),
    Character("Theo", "he", "tailor", "cat", "Socks", "Norvale", "blue", "toast"),
    Character("June", "she", "miller", "goat", "Daisy", "Drumland", "yellow", "corn"),
    Character("Amos", "he", "potter", "pig", "Hamlet", "Calmora", "black", "peaches"),
    Character("Cleo", "she", "cook", "owl", "Luna", "Iverra", "white", "pasta"),
    Character("Felix", "he", "musician", "frog", "Bubbles", "Sulvane", "gold", "figs"),
    Character("Iris", "she", "carpenter", "sheep", "Cotton", "Rusk", "grey", "pears"),
    Character("Jonah", "he", "librarian", "mouse", "Nibbles", "Quorra", "brown", "rice cakes"),
)

# Things and their one true color (countable nouns, so "a banana is yellow" reads well).
OBJECT_COLORS: dict[str, str] = {
    "banana": "yellow",
    "lemon": "yellow",
    "sunflower": "yellow",
    "leaf": "green",
    "cucumber": "green",
    "lime": "green",
    "tomato": "red",
    "strawberry": "red",
    "cherry": "red",
    "ladybug": "red",
    "carrot": "orange",
    "pumpkin": "orange",
    "tangerine": "orange",
    "plum": "purple",
    "grape": "purple",
    "eggplant": "purple",
    "crow": "black",
    "lump of coal": "black",
    "chestnut": "brown",
    "acorn": "brown",
    "coconut": "brown",
    "snowball": "white",
    "swan": "white",
    "cloud": "white",
    "blueberry": "blue",
    "bluebird": "blue",
    "sapphire": "blue",
    "flamingo": "pink",
    "rose petal": "pink",
    "pebble": "grey",
    "elephant": "grey",
}

ANIMAL_SOUNDS: dict[str, str] = {
    "cow": "moo",
    "dog": "woof",
    "cat": "meow",
    "duck": "quack",
    "sheep": "baa",
    "pig": "oink",
    "horse": "neigh",
    "owl": "hoot",
    "frog": "ribbit",
    "goat": "maa",
    "mouse": "squeak",
    "lion": "roar",
    "bee": "buzz",
    "snake": "hiss",
    "crow": "caw",
    "rooster": "cock-a-doodle-doo",
}

OPPOSITES: dict[str, str] = {
    "hot": "cold",
    "big": "small",
    "fast": "slow",
    "up": "down",
    "day": "night",
    "happy": "sad",
    "wet": "dry",
    "old": "young",
    "open": "closed",
    "loud": "quiet",
    "full": "empty",
    "light": "dark",
    "early": "late",
    "tall": "short",
    "hard": "soft",
    "first": "last",
}

NUMBER_WORDS: tuple[str, ...] = (
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten",
    "eleven", "twelve", "thirteen", "fourteen", "fifteen", "sixteen", "seventeen",
    "eighteen", "nineteen", "twenty",
)  # fmt: skip

DAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")
MONTHS = (
    "January", "February", "March", "April", "May", "June", "July", "August",
    "September", "October", "November", "December",
)  # fmt: skip

# Scenery and small vocabulary that carries no facts.
PLACES = (
    "the bridge", "the old mill", "the garden", "the harbor", "the bakery", "the school",
    "the library", "the park", "the forest", "the market", "the river", "the hill",
    "the well", "the barn", "the square", "the station",
)  # fmt: skip
FOODS = (
    ("apple", "apples"), ("pear", "pears"), ("egg", "eggs"), ("carrot", "carrots"),
    ("melon", "melons"), ("walnut", "walnuts"), ("radish", "radishes"), ("pie", "pies"),
    ("turnip", "turnips"), ("olive", "olives"), ("cabbage", "cabbages"),
    ("bun", "buns"), ("cookie", "cookies"), ("lemon", "lemons"), ("cherry", "cherries"),
    ("potato", "potatoes"), ("onion", "onions"), ("peach", "peaches"), ("loaf", "loaves"),
)  # fmt: skip
WEATHER = ("sunny", "rainy", "windy", "cloudy", "snowy", "foggy", "warm", "cold", "bright")
TIMES = ("morning", "afternoon", "evening")
FEELINGS = (
    "happy", "tired", "proud", "excited", "calm", "curious", "glad", "cheerful",
    "sleepy", "hungry", "thankful", "brave", "hopeful", "relieved", "cozy", "content",
    "amazed", "cheery", "peaceful", "lucky",
)  # fmt: skip
PLACE_LOOKS = (
    "quiet", "busy", "old", "bright", "narrow", "wide", "muddy", "sleepy", "crowded",
    "peaceful", "noisy", "clean", "dusty", "shady", "cheerful", "windy", "cool", "lovely",
    "empty", "golden", "grassy", "damp", "sunny", "silent", "charming", "colorful",
)  # fmt: skip
SIGHTS = (
    "children playing with a ball", "an old man feeding the birds", "a cart full of hay",
    "two dogs chasing each other", "a woman selling flowers", "boats resting by the shore",
    "smoke rising from a chimney", "a boy flying a kite", "a girl reading under a tree",
    "a cat sleeping on a wall", "leaves dancing in the wind", "a band playing music",
    "a farmer mending a fence", "two sisters painting a boat", "a baby giggling in a pram",
    "a horse drinking from a trough", "a juggler tossing five balls", "geese marching in a line",
    "an artist sketching the tower", "a boy skipping stones on the water",
    "a grandmother knitting on a bench", "squirrels racing up an oak tree",
    "a postman whistling a tune", "a girl carrying a basket of eggs",
)  # fmt: skip
SHELTERS = ("the barn", "the bakery", "the library", "the school", "the station", "the old mill")
TRANSITIONS = ("Later,", "After that,", "Soon,", "Then", "Meanwhile,", "The next day,")
CLOTHES = (
    "hat", "scarf", "coat", "jacket", "sweater", "cap", "cloak", "apron", "dress", "shirt",
    "vest", "pair of boots", "pair of gloves", "ribbon",
)  # fmt: skip
# Scenery clauses: words for variety, no facts.
SCENERY = (
    "the birds sang in the hedges", "the river sparkled under the bridge",
    "a gentle breeze moved the curtains", "the bells of the tower rang twice",
    "the smell of fresh bread drifted down the street", "puddles shone on the cobblestones",
    "the hills were covered in purple heather", "lanterns swayed above the doorways",
    "the leaves rustled in the orchard", "a thin mist lay over the meadow",
    "the rooftops glittered with frost", "bees hummed around the clover",
    "the shadows grew long across the square", "gulls circled over the harbor",
    "the wheat in the fields bent in the wind", "a rooster crowed somewhere far away",
    "the clouds drifted slowly toward the mountains", "children laughed behind a garden wall",
    "the old clock in the hall ticked loudly", "the pond was still as glass",
    "sunlight poured through the open windows", "the wind whistled through the chimneys",
    "snow crunched under every boot", "the market stalls were bright with ribbons",
    "a cart rattled over the stones", "the scent of pine filled the valley",
    "the stars came out one by one", "rain tapped softly on the roof",
    "the waves rolled gently onto the sand", "the fence posts were wet with dew",
    "a kettle whistled in a nearby kitchen", "the moon rose above the treetops",
    "blossoms floated down from the cherry trees", "thunder grumbled beyond the hills",
    "the lake reflected the pale sky", "smoke curled from the blacksmith's forge",
)  # fmt: skip
JOB_WORK: dict[str, tuple[str, str, str]] = {
    # job: (past-tense verb, singular unit, plural unit)
    "baker": ("baked", "loaf of bread", "loaves of bread"),
    "farmer": ("picked", "basket of apples", "baskets of apples"),
    "teacher": ("read", "story", "stories"),
    "sailor": ("tied", "knot", "knots"),
    "doctor": ("visited", "patient", "patients"),
    "painter": ("painted", "picture", "pictures"),
    "gardener": ("planted", "tree", "trees"),
    "builder": ("built", "wall", "walls"),
    "tailor": ("sewed", "shirt", "shirts"),
    "fisher": ("caught", "fish", "fish"),
    "potter": ("made", "bowl", "bowls"),
    "miller": ("ground", "sack of flour", "sacks of flour"),
    "librarian": ("sorted", "shelf of books", "shelves of books"),
    "carpenter": ("made", "chair", "chairs"),
    "musician": ("played", "song", "songs"),
    "cook": ("cooked", "meal", "meals"),
}


# ---------------------------------------------------------------------------
# Fact lookups (for documents and for task files).
# ---------------------------------------------------------------------------

COUNTRY_BY_NAME = {country.name: country for country in COUNTRIES}
CAPITALS: dict[str, str] = {country.name: country.capital for country in COUNTRIES}


def country_of(character: Character) -> Country:
    return COUNTRY_BY_NAME[character.home]


def number_word(n: int) -> str:
    return NUMBER_WORDS[n]


def addition_facts() -> list[tuple[int, int, int]]:
    """Every ``a + b = c`` with ``c <= 20`` that the corpus states."""
    return [(a, b, a + b) for a in range(11) for b in range(11) if a + b <= 20]


def subtraction_facts() -> list[tuple[int, int, int]]:
    return [(a, b, a - b) for a in range(21) for b in range(min(a, 10) + 1)]


def multiplication_facts() -> list[tuple[int, int, int]]:
    return [(a, b, a * b) for a in range(1, 6) for b in range(1, 6) if a * b <= 20]


# ---------------------------------------------------------------------------
# Text helpers.
# ---------------------------------------------------------------------------


def indefinite(noun: str) -> str:
    """The noun with its indefinite article: "a dog", "an owl"."""
    return f"{article(noun)} {noun}"


def cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def counted(n: int, singular: str, plural: str) -> str:
    return f"{number_word(n)} {singular if n == 1 else plural}"


def join_words(words: Sequence[str]) -> str:
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " and " + words[-1]


def paragraph(sentences: Sequence[str]) -> str:
    return " ".join(sentences)


class Writer:
    """A seeded random source with the choices the templates need."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def pick(self, options: Sequence[T]) -> T:
        return self.rng.choice(options)

    def some(self, options: Sequence[T], k: int) -> list[T]:
        return self.rng.sample(list(options), k)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def number(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def character(self, *, other_than: Sequence[Character] = ()) -> Character:
        return self.pick([c for c in CHARACTERS if c not in other_than])

    def country(self, *, other_than: Sequence[str] = ()) -> Country:
        return self.pick([c for c in COUNTRIES if c.name not in other_than])


# ---------------------------------------------------------------------------
# Sentence builders that state facts, in several phrasings.
# ---------------------------------------------------------------------------


def capital_sentence(w: Writer, country: Country) -> str:
    return w.pick(
        [
            f"The capital of {country.name} is {country.capital}.",
            f"{country.capital} is the capital of {country.name}.",
            f"The capital city of {country.name} is {country.capital}.",
        ]
    )


def other_country_facts(country: Country) -> list[str]:
    """Everything the corpus says about a country besides its capital."""
    c1, c2 = country.flag
    return [
        f"The flag of {country.name} is {c1} and {c2}.",
        f"{country.name} is famous for its {country.export}.",
        f"The national animal of {country.name} is the {country.animal}.",
        f"The weather in {country.name} is often {country.climate}.",
    ]


def country_fact(w: Writer, country: Country) -> str:
    return w.pick([capital_sentence(w, country), *other_country_facts(country)])


def color_sentence(w: Writer, thing: str) -> str:
    color = OBJECT_COLORS[thing]
    return w.pick(
        [
            f"{cap(indefinite(thing))} is {color}.",
            f"The color of {indefinite(thing)} is {color}.",
            f"{cap(indefinite(thing))} is always {color}.",
        ]
    )


def sound_sentence(w: Writer, animal: str) -> str:
    sound = ANIMAL_SOUNDS[animal]
    return w.pick(
        [
            f"The {animal} says {sound}.",
            f"{cap(indefinite(animal))} says {sound}.",
            f"When you hear {sound}, it is {indefinite(animal)}.",
        ]
    )


def arithmetic_sentence(w: Writer) -> str:
    kind = w.pick(["plus", "plus", "minus", "times"])
    if kind == "plus":
        a, b, c = w.pick(addition_facts())
    elif kind == "minus":
        a, b, c = w.pick(subtraction_facts())
    else:
        a, b, c = w.pick(multiplication_facts())
    text = f"{number_word(a)} {kind} {number_word(b)} is {number_word(c)}."
    return cap(text)


def person_fact(w: Writer, person: Character) -> str:
    home = country_of(person)
    return w.pick(
        [
            f"{person.name} has {indefinite(person.pet)} named {person.pet_name}.",
            f"{person.name} lives in {home.capital}, the capital of {home.name}.",
            f"{person.name} is a {person.job}.",
            f"{person.name}'s favorite color is {person.favorite_color}.",
            f"{person.name} likes to eat {person.favorite_food}.",
        ]
    )


# ---------------------------------------------------------------------------
# Story parts. Each returns one paragraph about ``hero``.
# ---------------------------------------------------------------------------


def story_intro(w: Writer, hero: Character) -> str:
    home = country_of(hero)
    opening = w.pick(
        [
            f"Once upon a time, in the city of {home.capital}, there lived a {hero.job} named {hero.name}.",
            f"{hero.name} was a {hero.job} who lived in {home.capital}, the capital of {home.name}.",
            f"In {home.capital}, the capital of {home.name}, there was a {hero.job} called {hero.name}.",
            f"This is a story about {hero.name}, a {hero.job} from {home.capital}.",
        ]
    )
    pet = w.pick(
        [
            f"{cap(hero.subject)} had {indefinite(hero.pet)} named {hero.pet_name}.",
            f"{hero.name} has {indefinite(hero.pet)} named {hero.pet_name}.",
        ]
    )
    details = [
        pet,
        f"{hero.name}'s favorite color was {hero.favorite_color}, so {hero.subject} often wore a "
        f"{hero.favorite_color} {w.pick(CLOTHES)}.",
        f"Every {w.pick(TIMES)}, {hero.name} ate {hero.favorite_food}.",
        f"The weather in {home.name} is often {home.climate}.",
    ]
    return paragraph([opening, *w.some(details, w.number(2, 4))])


def story_setting(w: Writer) -> str:
    day, weather, time = w.pick(DAYS), w.pick(WEATHER), w.pick(TIMES)
    first, second = w.some(SCENERY, 2)
    opening = w.pick(
        [
            f"It was a {weather} {day} {time}.",
            f"One {weather} {time} in {w.pick(MONTHS)}, the town was quiet.",
            f"On {day}, the {time} was {weather}.",
        ]
    )
    return paragraph([opening, f"{cap(first)}, and {second}."])


def plot_market(w: Writer, hero: Character) -> str:
    (one_a, many_a), (one_b, many_b) = w.some(FOODS, 2)
    n, m = w.number(1, 9), w.number(1, 9)
    coins = w.number(n + m, 20)
    total = n + m
    return paragraph(
        [
            w.pick(
                [
                    f"{hero.name} took a basket and walked to the market.",
                    f"{hero.name} needed food, so {hero.subject} went to the market.",
                ]
            ),
            f"{cap(hero.subject)} had {counted(coins, 'coin', 'coins')} in {hero.possessive} pocket.",
            f"First, {hero.subject} bought {counted(n, one_a, many_a)}.",
            f"Then {hero.subject} saw some fresh {many_b} and bought {number_word(m)}.",
            f"Each one cost one coin, so {hero.subject} paid {counted(total, 'coin', 'coins')}.",
            f"{cap(number_word(n))} plus {number_word(m)} is {number_word(total)}.",
            f"{hero.name} had {number_word(coins)} coins, and {number_word(coins)} minus "
            f"{number_word(total)} is {number_word(coins - total)}, so "
            f"{counted(coins - total, 'coin was', 'coins were')} left.",
        ]
    )


def plot_lost_pet(w: Writer, hero: Character) -> str:
    first, second, found = w.some(PLACES, 3)
    sound = ANIMAL_SOUNDS[hero.pet]
    return paragraph(
        [
            f"One day, {hero.pet_name} the {hero.pet} ran away.",
            f"{hero.name} was worried and looked everywhere.",
            f"{cap(hero.subject)} looked near {first}, but {hero.pet_name} was not there.",
            f"{cap(hero.subject)} looked near {second}, but {hero.pet_name} was not there either.",
            f'At last, {hero.subject} heard a sound from {found}: "{cap(sound)}! {cap(sound)}!"',
            f"It was {hero.pet_name}! {cap(indefinite(hero.pet))} says {sound}, and {hero.name} knew that sound well.",
            f'"Please do not run away again," said {hero.name}, and {hero.subject} took '
            f"{hero.pet_name} home.",
        ]
    )


def plot_journey(w: Writer, hero: Character) -> str:
    dest = w.country(other_than=[hero.home])
    friends = [c for c in CHARACTERS if c.home == dest.name]
    c1, c2 = dest.flag
    days = w.number(2, 9)
    sentences = [
        f"{hero.name} decided to travel to {dest.capital}, the capital of {dest.name}.",
        f"The journey took {counted(days, 'day', 'days')}.",
        f"When {hero.subject} arrived, {hero.subject} saw the flag of {dest.name}. "
        f"It was {c1} and {c2}.",
        f"{dest.name} is famous for its {dest.export}, so {hero.name} bought some {dest.export} "
        f"to take home.",
        f"The weather in {dest.name} is often {dest.climate}, and it was {dest.climate} that day.",
    ]
    if friends:
        friend = w.pick(friends)
        sentences += [
            f'"Welcome to {dest.capital}!" said {friend.name}, a {friend.job} who lived there.',
            f'"Is {dest.capital} the capital of {dest.name}?" asked {hero.name}.',
            f'"Yes," said {friend.name}. "{capital_sentence(w, dest)} '
            f'And the national animal of {dest.name} is the {dest.animal}."',
        ]
    else:
        sentences.append(
            f"In {dest.name}, {hero.subject} saw a {dest.animal}, the national animal."
        )
    return paragraph(sentences)


def plot_found_thing(w: Writer, hero: Character) -> str:
    thing = w.pick(list(OBJECT_COLORS))
    color = OBJECT_COLORS[thing]
    friend = w.character(other_than=[hero])
    same = [t for t, c in OBJECT_COLORS.items() if c == color and t != thing]
    sentences = [
        f"While walking near {w.pick(PLACES)}, {hero.name} found {indefinite(thing)}.",
        f'"What color is it?" asked {friend.name}.',
        f'"It is {color}," said {hero.name}. "{color_sentence(w, thing)}"',
    ]
    if same:
        other = w.pick(same)
        sentences.append(f"The {thing} was {color}, the same color as {indefinite(other)}.")
    if color == hero.favorite_color:
        sentences.append(
            f"{hero.name} smiled, because {color} was {hero.possessive} favorite color."
        )
    sentences.append(f"{hero.name} gave the {thing} to {friend.name}, who said thank you.")
    return paragraph(sentences)


def plot_work(w: Writer, hero: Character) -> str:
    verb, one, many = JOB_WORK[hero.job]
    n, m = w.number(1, 10), w.number(1, 10)
    return paragraph(
        [
            w.pick(
                [
                    f"{hero.name} went to work early.",
                    f"After breakfast, {hero.name} started work.",
                ]
            ),
            f"As a {hero.job}, {hero.subject} {verb} {counted(n, one, many)} before noon.",
            f"After lunch, {hero.subject} {verb} {number_word(m)} more.",
            f"{cap(number_word(n))} plus {number_word(m)} is {number_word(n + m)}, so "
            f"{hero.subject} {verb} {counted(n + m, one, many)} that day.",
            f"{hero.name} felt {w.pick(FEELINGS)}.",
        ]
    )


def plot_farm_visit(w: Writer, hero: Character) -> str:
    animals = w.some(["cow", "sheep", "pig", "horse", "duck", "goat", "rooster"], 3)
    counts = [w.number(2, 6) for _ in animals]
    sentences = [f"{hero.name} visited a farm outside {country_of(hero).capital}."]
    for animal, count in zip(animals, counts, strict=True):
        plural = animal if animal == "sheep" else animal + "s"
        sentences.append(f"There were {number_word(count)} {plural}.")
        sentences.append(sound_sentence(w, animal))
    total = sum(counts)
    sentences.append(
        f"{hero.name} counted all the animals: there were {number_word(total)} in all."
    )
    return paragraph(sentences)


def plot_meeting(w: Writer, hero: Character) -> str:
    friend = w.character(other_than=[hero])
    place = w.pick(PLACES)
    return paragraph(
        [
            f"Near {place}, {hero.name} met {friend.name}, the {friend.job}.",
            f'"How is {friend.pet_name}?" asked {hero.name}.',
            f'"{friend.pet_name} is well," said {friend.name}. '
            f'"You know, {friend.pet_name} is my {friend.pet}."',
            f'"And how is your {hero.pet}, {hero.pet_name}?" asked {friend.name}.',
            f'"{hero.pet_name} is {w.pick(FEELINGS)} today," said {hero.name}.',
            f"They talked until the {w.pick(TIMES)} was over.",
        ]
    )


def plot_storm(w: Writer, hero: Character) -> str:
    friend = w.character(other_than=[hero])
    sacks = w.number(2, 10)
    return paragraph(
        [
            f"In the {w.pick(TIMES)}, dark clouds came over {country_of(hero).capital}.",
            "The wind grew strong and the rain began to fall.",
            f"{hero.name} ran to help {friend.name}, the {friend.job}, who had "
            f"{counted(sacks, 'sack', 'sacks')} of grain outside.",
            f"Together they carried the sacks into {w.pick(SHELTERS)}, one by one, until all "
            f"{number_word(sacks)} were dry.",
            f"{hero.pet_name} the {hero.pet} hid under the table and said "
            f"{ANIMAL_SOUNDS[hero.pet]} only once.",
            f"When the storm was over, the sky was blue again and {hero.name} felt "
            f"{w.pick(FEELINGS)}.",
        ]
    )


def plot_festival(w: Writer, hero: Character) -> str:
    home = country_of(hero)
    c1, c2 = home.flag
    songs = w.number(3, 12)
    return paragraph(
        [
            f"That week there was a festival in {home.capital}.",
            f"The streets were {w.pick(PLACE_LOOKS)} and full of {c1} and {c2} flags, "
            f"because the flag of {home.name} is {c1} and {c2}.",
            f"People sold {home.export}, since {home.name} is famous for its {home.export}.",
            f"{hero.name} saw {w.pick(SIGHTS)} and {w.pick(SIGHTS)}.",
            f"A band played {number_word(songs)} songs, and {hero.name} danced to "
            f"{number_word(w.number(1, songs))} of them.",
            f"At the end, someone dressed as {indefinite(home.animal)}, the "
            f"national animal of {home.name}, waved to the crowd.",
        ]
    )


def plot_cooking(w: Writer, hero: Character) -> str:
    friend = w.character(other_than=[hero])
    (one_a, many_a), (one_b, many_b) = w.some(FOODS, 2)
    a, b = w.number(1, 8), w.number(1, 8)
    return paragraph(
        [
            f"{hero.name} invited {friend.name} for dinner and cooked {hero.favorite_food}.",
            f"{cap(hero.subject)} used {counted(a, one_a, many_a)} and "
            f"{counted(b, one_b, many_b)}.",
            f"{friend.name} brought {friend.favorite_food}, because {friend.name} likes to "
            f"eat {friend.favorite_food}.",
            f'"This is {w.pick(["delicious", "wonderful", "very tasty", "lovely"])}," said '
            f"{friend.name}.",
            f"After dinner they walked to {w.pick(PLACES)}, which was "
            f"{w.pick(PLACE_LOOKS)} at that hour.",
        ]
    )


def plot_walk(w: Writer, hero: Character) -> str:
    first, second = w.some(PLACES, 2)
    return paragraph(
        [
            f"{w.pick(TRANSITIONS)} {hero.name} took {hero.pet_name} for a walk.",
            f"They passed {first}, which was {w.pick(PLACE_LOOKS)}, and saw {w.pick(SIGHTS)}.",
            f"Near {second} they saw {w.pick(SIGHTS)}.",
            f"{hero.pet_name} said {ANIMAL_SOUNDS[hero.pet]}, as {article(hero.pet)} "
            f"{hero.pet} does.",
            f"The air was {w.pick(['fresh', 'cool', 'warm', 'sweet'])}, and {hero.name} felt "
            f"{w.pick(FEELINGS)}.",
        ]
    )


PLOTS: tuple[Callable[[Writer, Character], str], ...] = (
    plot_storm,
    plot_festival,
    plot_cooking,
    plot_walk,
    plot_market,
    plot_lost_pet,
    plot_journey,
    plot_found_thing,
    plot_work,
    plot_farm_visit,
    plot_meeting,
)


def story_ending(w: Writer, hero: Character) -> str:
    return w.pick(
        [
            f"That night, {hero.name} went to sleep {w.pick(FEELINGS)}. The end.",
            f"And so the day ended well for {hero.name} and {hero.pet_name}.",
            f"When {hero.name} got home, {hero.pet_name} the {hero.pet} was waiting at the door.",
            f"It had been a good day in {country_of(hero).capital}.",
        ]
    )


def story(w: Writer) -> str:
    hero = w.character()
    plots = w.some(PLOTS, w.number(2, 4))
    parts = [story_intro(w, hero), story_setting(w)]
    parts += [plot(w, hero) for plot in plots]
    parts.append(story_ending(w, hero))
    return "\n\n".join(parts)


# ---------------------------------------------------------------------------
# Lessons, dialogues and letters.
# ---------------------------------------------------------------------------


def lesson_countries(w: Writer) -> str:
    countries = w.some(COUNTRIES, w.number(3, 5))
    lines = [f"Lesson: the countries of {join_words([c.name for c in countries])}."]
    for country in countries:
        facts = w.some(other_country_facts(country), w.number(2, 4))
        lines.append(paragraph([capital_sentence(w, country), *facts]))
    quiz = w.pick(countries)
    lines.append(
        f"Question: What is the capital of {quiz.name}? "
        f"Answer: The capital of {quiz.name} is {quiz.capital}."
    )
    return "\n\n".join(lines)


def lesson_colors(w: Writer) -> str:
    things = w.some(list(OBJECT_COLORS), w.number(6, 10))
    lines = [w.pick(["Lesson: colors around us.", "Colors of things.", "What color is it?"])]
    lines.append(paragraph([color_sentence(w, thing) for thing in things]))
    color = OBJECT_COLORS[w.pick(things)]
    group = [t for t, c in OBJECT_COLORS.items() if c == color]
    lines.append(f"Things that are {color}: {join_words([f'{indefinite(t)}' for t in group])}.")
    quiz = w.pick(things)
    lines.append(
        f"Question: What color is {indefinite(quiz)}? "
        f"Answer: {cap(indefinite(quiz))} is {OBJECT_COLORS[quiz]}."
    )
    return "\n\n".join(lines)


def lesson_sounds(w: Writer) -> str:
    animals = w.some(list(ANIMAL_SOUNDS), w.number(6, 10))
    lines = [w.pick(["Lesson: what do the animals say?", "Animal sounds."])]
    lines.append(paragraph([sound_sentence(w, animal) for animal in animals]))
    quiz = w.pick(animals)
    lines.append(
        f"Question: What does the {quiz} say? Answer: The {quiz} says {ANIMAL_SOUNDS[quiz]}."
    )
    return "\n\n".join(lines)


def lesson_numbers(w: Writer) -> str:
    top = w.number(5, 20)
    start = w.number(0, top - 3)
    lines = [
        "Lesson: numbers.",
        f"Let us count from {number_word(start)} to {number_word(top)}: "
        + ", ".join(NUMBER_WORDS[start : top + 1])
        + ".",
    ]
    n = w.number(0, 19)
    lines.append(
        f"The number after {number_word(n)} is {number_word(n + 1)}. "
        f"The number before {number_word(n + 1)} is {number_word(n)}."
    )
    lines.append(paragraph([arithmetic_sentence(w) for _ in range(w.number(6, 12))]))
    a, b, c = w.pick(addition_facts())
    lines.append(
        f"{cap(number_word(a))} plus {number_word(b)} is {number_word(c)}, "
        f"and {number_word(b)} plus {number_word(a)} is also {number_word(c)}."
    )
    return "\n\n".join(lines)


def lesson_word_problems(w: Writer) -> str:
    lines = ["Lesson: word problems."]
    for _ in range(w.number(3, 5)):
        person, friend = w.some(CHARACTERS, 2)
        one, many = w.pick(FOODS)
        if w.chance(0.5):
            a, b, c = w.pick([f for f in addition_facts() if f[0] > 0 and f[1] > 0])
            lines.append(
                f"{person.name} has {counted(a, one, many)}. {friend.name} gives "
                f"{person.object} {number_word(b)} more. Now {person.name} has "
                f"{counted(c, one, many)}, because {number_word(a)} plus {number_word(b)} "
                f"is {number_word(c)}."
            )
        else:
            a, b, c = w.pick([f for f in subtraction_facts() if f[0] > 0 and f[1] > 0])
            lines.append(
                f"{person.name} has {counted(a, one, many)}. {cap(person.subject)} gives "
                f"{number_word(b)} to {friend.name}. Now {person.name} has "
                f"{counted(c, one, many)}, because {number_word(a)} minus {number_word(b)} "
                f"is {number_word(c)}."
            )
    return "\n\n".join(lines)


def lesson_calendar(w: Writer) -> str:
    d = w.number(0, 5)
    m = w.number(0, 10)
    word = w.pick(list(OPPOSITES))
    return "\n\n".join(
        [
            "Lesson: days, months and opposites.",
            paragraph(
                [
                    "There are seven days in a week: " + join_words(DAYS) + ".",
                    f"After {DAYS[d]} comes {DAYS[d + 1]}.",
                    "There are twelve months in a year.",
                    f"After {MONTHS[m]} comes {MONTHS[m + 1]}.",
                ]
            ),
            paragraph(
                [
                    f"The opposite of {a} is {b}."
                    for a, b in w.some(list(OPPOSITES.items()), w.number(4, 7))
                ]
            ),
            f"Question: What is the opposite of {word}? Answer: The opposite of {word} is "
            f"{OPPOSITES[word]}.",
        ]
    )


def profile(w: Writer) -> str:
    people = w.some(CHARACTERS, w.number(2, 4))
    lines = [w.pick(["Meet the neighbors.", "People we know.", "Friends from far away."])]
    for person in people:
        home = country_of(person)
        lines.append(
            paragraph(
                [
                    f"{person.name} lives in {home.capital}, the capital of {home.name}.",
                    f"{cap(person.subject)} is a {person.job}.",
                    f"{person.name} has {indefinite(person.pet)} named {person.pet_name}.",
                    sound_sentence(w, person.pet),
                    f"{cap(person.possessive)} favorite color is {person.favorite_color}, and "
                    f"{person.subject} likes to eat {person.favorite_food}.",
                ]
            )
        )
    return "\n\n".join(lines)


def quiz_question(w: Writer) -> tuple[str, str]:
    """A (question, correct answer) pair about some fact of the world."""
    kind = w.pick(["capital", "color", "sound", "math", "pet", "home", "flag"])
    if kind == "capital":
        c = w.pick(COUNTRIES)
        return f"What is the capital of {c.name}?", f"The capital of {c.name} is {c.capital}."
    if kind == "flag":
        c = w.pick(COUNTRIES)
        return f"What colors are on the flag of {c.name}?", (
            f"The flag of {c.name} is {c.flag[0]} and {c.flag[1]}."
        )
    if kind == "color":
        t = w.pick(list(OBJECT_COLORS))
        return f"What color is {indefinite(t)}?", f"{cap(indefinite(t))} is {OBJECT_COLORS[t]}."
    if kind == "sound":
        a = w.pick(list(ANIMAL_SOUNDS))
        return f"What does the {a} say?", f"The {a} says {ANIMAL_SOUNDS[a]}."
    if kind == "math":
        a, b, c = w.pick(addition_facts())
        return (
            f"What is {number_word(a)} plus {number_word(b)}?",
            f"{cap(number_word(a))} plus {number_word(b)} is {number_word(c)}.",
        )
    p = w.pick(CHARACTERS)
    if kind == "pet":
        return (
            f"What pet does {p.name} have?",
            f"{p.name} has {indefinite(p.pet)} named {p.pet_name}.",
        )
    home = country_of(p)
    return f"Where does {p.name} live?", f"{p.name} lives in {home.capital}, in {home.name}."


def dialogue_quiz(w: Writer) -> str:
    students = w.some(CHARACTERS, w.number(2, 3))
    lines = [f"Teacher: Good {w.pick(TIMES)}, class. Today we have a quiz."]
    asked: set[str] = set()
    for _ in range(w.number(6, 10)):
        student = w.pick(students)
        question, answer = quiz_question(w)
        if question in asked:
            continue
        asked.add(question)
        lines.append(f"Teacher: {question}")
        lines.append(f"{student.name}: {answer}")
        lines.append(
            f"Teacher: {w.pick(['Very good.', 'Correct!', 'Well done.', 'Yes, that is right.'])}"
        )
    lines.append(f"{w.pick(students).name}: Thank you, teacher!")
    return "\n".join(lines)


def dialogue_chat(w: Writer) -> str:
    a, b = w.some(CHARACTERS, 2)
    b_home = country_of(b)
    dest = w.country(other_than=[b.home])
    n = w.number(2, 9)
    one, many = w.pick(FOODS)
    return "\n".join(
        [
            f"{a.name}: Hello, {b.name}! How are you?",
            f"{b.name}: I am {w.pick(FEELINGS)}, thank you. And you?",
            f"{a.name}: I am well. How is {b.pet_name}?",
            f"{b.name}: {b.pet_name} is fine. {cap(indefinite(b.pet))} says "
            f"{ANIMAL_SOUNDS[b.pet]}, and {b.pet_name} says it all day!",
            f"{a.name}: Are you still living in {b_home.capital}?",
            f"{b.name}: Yes, I live in {b_home.capital}, the capital of {b_home.name}. "
            f"Tomorrow I am going to {dest.capital}.",
            f"{a.name}: {dest.capital}? {capital_sentence(w, dest)} {country_fact(w, dest)}",
            f"{b.name}: That is right. Do you want some {many}? I have {number_word(n)}.",
            f"{a.name}: Yes, please. Can I have {number_word(n // 2 or 1)}?",
            f"{b.name}: Of course. Then I will have {number_word(n - (n // 2 or 1))} left.",
            f"{a.name}: Goodbye, {b.name}!",
            f"{b.name}: Goodbye!",
        ]
    )


def letter(w: Writer) -> str:
    writer, reader = w.some(CHARACTERS, 2)
    home = country_of(writer)
    thing = w.pick(list(OBJECT_COLORS))
    verb, one, many = JOB_WORK[writer.job]
    reader_home = country_of(reader)
    return "\n\n".join(
        [
            f"Dear {reader.name},",
            paragraph(
                [
                    f"I am writing to you from {home.capital}, the capital of {home.name}.",
                    f"The weather here is {home.climate}, as it often is in {home.name}.",
                    f"My {writer.pet}, {writer.pet_name}, says hello. Well, {writer.pet_name} "
                    f"says {ANIMAL_SOUNDS[writer.pet]}, because {article(writer.pet)} "
                    f"{writer.pet} says {ANIMAL_SOUNDS[writer.pet]}.",
                ]
            ),
            paragraph(
                [
                    f"At work I {verb} {counted(w.number(2, 12), one, many)} this week.",
                    f"Yesterday I walked to {w.pick(PLACES)}. It was {w.pick(PLACE_LOOKS)}, "
                    f"and I saw {w.pick(SIGHTS)}.",
                    f"Today I saw {indefinite(thing)}. It was {OBJECT_COLORS[thing]}, of course.",
                    f"For dinner I will eat {writer.favorite_food}, my favorite food.",
                ]
            ),
            paragraph(
                [
                    f"How is {reader.pet_name} the {reader.pet}?",
                    f"Is it still {reader_home.climate} in {reader_home.capital}?",
                    f"One day I will visit you in {reader_home.name}. I hear that "
                    f"{reader_home.name} is famous for its {reader_home.export}.",
                    "Please write back soon.",
                ]
            ),
            f"Your friend,\n{writer.name}",
        ]
    )


LESSONS: tuple[Callable[[Writer], str], ...] = (
    lesson_countries,
    lesson_countries,
    lesson_colors,
    lesson_sounds,
    lesson_numbers,
    lesson_numbers,
    lesson_word_problems,
    lesson_calendar,
)


def lessons(w: Writer) -> str:
    """A page of a school book: two or three lessons."""
    return "\n\n".join(lesson(w) for lesson in w.some(LESSONS, w.number(2, 3)))


DOCUMENT_KINDS: tuple[tuple[Callable[[Writer], str], int], ...] = (
    # (builder, weight)
    (story, 50),
    (lessons, 20),
    (profile, 6),
    (dialogue_quiz, 9),
    (dialogue_chat, 8),
    (letter, 7),
)


def generate_documents(seed: int = 0, count: int = DEFAULT_DOCUMENTS) -> Iterator[dict[str, str]]:
    """Yield ``{"text": ..., "id": ...}`` records; same seed and count, same records."""
    w = Writer(random.Random(seed))
    builders = [builder for builder, _ in DOCUMENT_KINDS]
    weights = [weight for _, weight in DOCUMENT_KINDS]
    for index in range(count):
        builder = w.rng.choices(builders, weights)[0]
        yield {"text": builder(w), "id": f"stories-{index:05d}"}


def write_corpus(output: str | Path, seed: int = 0, count: int = DEFAULT_DOCUMENTS) -> int:
    """Write the corpus as jsonl; returns the number of bytes written."""
    lines = [json.dumps(doc, ensure_ascii=False) for doc in generate_documents(seed, count)]
    data = ("\n".join(lines) + "\n").encode("utf-8")
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return len(data)


# ---------------------------------------------------------------------------
# Zero-shot multiple-choice items over the same facts.
# ---------------------------------------------------------------------------


def _choices(w: Writer, answer: str, pool: Sequence[str], k: int) -> tuple[list[str], int]:
    wrong = w.some(sorted(set(pool) - {answer}), k - 1)
    choices = [answer, *wrong]
    w.rng.shuffle(choices)
    return choices, choices.index(answer)


def multiple_choice_items(
    seed: int = 0, per_kind: int = 20, num_choices: int = 4
) -> list[dict[str, Any]]:
    """Cloze-style questions whose answers the corpus states many times.

    Each item is ``{"kind", "query", "choices", "answer"}``: the text to score is
    ``query + " " + choices[i]``, and ``answer`` is the index of the right choice.
    Phrasings match sentences in the corpus, e.g. "The capital of Valdoria is" → "Mirelle".
    """
    w = Writer(random.Random(seed))
    items: list[dict[str, Any]] = []

    def add(kind: str, query: str, answer: str, pool: Sequence[str]) -> None:
        choices, index = _choices(w, answer, pool, num_choices)
        items.append({"kind": kind, "query": query, "choices": choices, "answer": index})

    for country in w.some(COUNTRIES, min(per_kind, len(COUNTRIES))):
        add("capital", f"The capital of {country.name} is", country.capital, CAPITALS.values())
    colors = sorted(set(OBJECT_COLORS.values()))
    for thing in w.some(list(OBJECT_COLORS), min(per_kind, len(OBJECT_COLORS))):
        add("color", f"The color of {indefinite(thing)} is", OBJECT_COLORS[thing], colors)
    for animal in w.some(list(ANIMAL_SOUNDS), min(per_kind, len(ANIMAL_SOUNDS))):
        add("sound", f"The {animal} says", ANIMAL_SOUNDS[animal], list(ANIMAL_SOUNDS.values()))
    pets = sorted({indefinite(c.pet) for c in CHARACTERS})
    for person in w.some(CHARACTERS, min(per_kind, len(CHARACTERS))):
        add("pet", f"{person.name} has", indefinite(person.pet), pets)
    facts = addition_facts()
    for a, b, c in w.some(facts, min(per_kind, len(facts))):
        # Wrong answers are near the right one, so guessing by size does not help.
        near = [number_word(x) for x in range(max(0, c - 3), min(20, c + 3) + 1)]
        add("arithmetic", f"{cap(number_word(a))} plus {number_word(b)} is", number_word(c), near)
    return items


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="Where the jsonl goes.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--documents", type=int, default=DEFAULT_DOCUMENTS)
    args = parser.parse_args(argv)
    size = write_corpus(args.output, args.seed, args.documents)
    print(f"wrote {args.documents} documents, {size} bytes to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
