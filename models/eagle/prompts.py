"""A deterministic set of chat prompts for self-distilling a draft head and for benchmarking it.

No dataset is downloadable here, so prompts are built from task templates x subjects. The split is
by subject: `heldout_prompts()` uses subjects that never appear in `train_prompts()`, so the
benchmark measures acceptance on text the head was not trained on.
"""

from __future__ import annotations

import random

TEMPLATES = [
    "Explain {s} to a beginner.",
    "What is {s}? Answer in a few sentences.",
    "Write a short story that involves {s}.",
    "Give me five practical tips about {s}.",
    "What are the pros and cons of {s}?",
    "Write a short poem about {s}.",
    "How would you teach a child about {s}?",
    "Summarize the history of {s}.",
    "What are common misconceptions about {s}?",
    "Write a friendly email to a colleague about {s}.",
    "Describe {s} in three bullet points.",
    "Why does {s} matter today?",
    "Compare {s} with something similar and explain the differences.",
    "Write a product description for something related to {s}.",
    "What questions should I ask an expert on {s}?",
    "Give a step-by-step plan for learning about {s}.",
    "Write a dialogue between two friends discussing {s}.",
    "What is the most surprising fact about {s}?",
    "Write a haiku and then explain it. The theme is {s}.",
    "Create a short quiz with answers about {s}.",
]

SUBJECTS = [
    "photosynthesis",
    "black holes",
    "the water cycle",
    "volcanoes",
    "climate change",
    "the human heart",
    "vaccines",
    "electricity",
    "gravity",
    "DNA",
    "the moon landing",
    "the Roman Empire",
    "the printing press",
    "the French Revolution",
    "ancient Egypt",
    "the Silk Road",
    "the Renaissance",
    "the industrial revolution",
    "democracy",
    "machine learning",
    "the internet",
    "Python programming",
    "databases",
    "encryption",
    "open source software",
    "smartphones",
    "video games",
    "electric cars",
    "solar power",
    "recycling",
    "gardening",
    "baking bread",
    "making coffee",
    "healthy breakfast ideas",
    "running a marathon",
    "yoga",
    "sleep",
    "meditation",
    "learning a new language",
    "public speaking",
    "time management",
    "saving money",
    "investing",
    "starting a business",
    "job interviews",
    "remote work",
    "teamwork",
    "leadership",
    "friendship",
    "dogs",
    "cats",
    "honeybees",
    "whales",
    "rainforests",
    "deserts",
    "mountains",
    "the ocean",
    "rivers",
    "chess",
    "soccer",
    "the Olympic Games",
    "jazz music",
    "painting",
    "photography",
    "museums",
    "libraries",
    "poetry",
    "mythology",
    "dinosaurs",
    "the solar system",
    "Mars",
    "robots",
    "3D printing",
    "bridges",
    "trains",
    "airplanes",
    "bicycles",
    "city planning",
    "volunteering",
    "kindness",
    "curiosity",
    "winter",
    "summer holidays",
    "camping",
]

HELDOUT_SUBJECTS = [
    "earthquakes",
    "the immune system",
    "the Great Wall of China",
    "quantum computers",
    "wind turbines",
    "composting",
    "making pasta",
    "swimming",
    "journaling",
    "budget travel",
    "penguins",
    "coral reefs",
    "the Amazon river",
    "basketball",
    "classical music",
    "sculpture",
    "fairy tales",
    "comets",
    "drones",
    "lighthouses",
    "board games",
    "tea",
    "the stock market",
    "negotiation",
]


def _build(subjects: list[str], n: int, seed: int) -> list[str]:
    pairs = [(t, s) for s in subjects for t in TEMPLATES]
    random.Random(seed).shuffle(pairs)
    return [t.format(s=s) for t, s in pairs[:n]]


def train_prompts(n: int, seed: int = 0) -> list[str]:
    return _build(SUBJECTS, n, seed)


def heldout_prompts(n: int, seed: int = 1) -> list[str]:
    return _build(HELDOUT_SUBJECTS, n, seed)
