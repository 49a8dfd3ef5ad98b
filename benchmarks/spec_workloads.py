"""The prompts of benchmarks/spec_decode.py, as chat-templated token ids.

* copy: passages of ~800 tokens from this repository's docs to repeat or correct (an edit keeps most
  of the text);
* grounded: the same kind of passages with a question to answer from them, or to summarise;
* agent: one tool-calling conversation shape (tools, a request, the tool's JSON result, a follow-up)
  issued again and again with other values, as an agent loop does;
* chat: open questions with nothing to copy from.
"""
from __future__ import annotations

import glob
import json
import os
import random

COPY_TASKS = ("Repeat the following passage exactly, word for word.",
              "Correct the spelling mistakes in the following passage and write it out in full.")
GROUNDED_TASKS = ("Answer from the passage below: what does it say the server does, and how? Quote it.",
                  "Summarise the following passage, quoting its key sentences.")
CHAT = ("Tell me a short story about a dragon who learns to cook.", "What are three good habits for sleeping well?",
        "Write a poem about the autumn sea.", "Explain why the sky is blue to a child.",
        "What should I pack for a week of hiking in the mountains?", "Give me ideas for a birthday party.",
        "How do bees make honey?", "Describe a day in the life of a lighthouse keeper.")
TOOLS = [{"name": "get_weather", "description": "Current weather of a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                          "unit": {"type": "string", "enum": ["C", "F"]}}}},
         {"name": "book_table", "description": "Book a restaurant table",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "people": {"type": "integer"},
                                                          "time": {"type": "string"}}}}]
CITIES = ("Paris", "Lyon", "Berlin", "Madrid", "Rome", "Oslo", "Vienna", "Prague", "Lisbon", "Dublin")


def passages(tokenizer, n: int, length: int, offset: int = 0) -> list[str]:
    """``n`` passages of about ``length`` tokens of English prose from docs/ and README.md."""
    root = os.path.join(os.path.dirname(__file__), "..")
    text = " ".join(open(f).read() for f in sorted(glob.glob(os.path.join(root, "docs", "*.md"))) +
                    [os.path.join(root, "README.md")])
    words = [w for w in text.split() if w.isascii() and not w.startswith(("|", "`", "#"))]
    out, i = [], offset
    while len(out) < n:
        chunk = []
        while len(tokenizer.encode(" ".join(chunk))) < length:
            chunk += words[i:i + 40]
            i = (i + 40) % max(1, len(words) - 40)     # wraps round when the docs run out
        out.append(" ".join(chunk))
    return out


def misspell(text: str, rng: random.Random) -> str:
    words = text.split()
    for j in rng.sample(range(len(words)), len(words) // 15):
        w = words[j]
        if len(w) > 3:
            k = rng.randrange(1, len(w) - 1)
            words[j] = w[:k] + w[k + 1] + w[k] + w[k + 2:]
    return " ".join(words)


def _chat(llm, content: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": content}])


def copy_prompts(llm, n: int, length: int) -> list[list[int]]:
    rng = random.Random(0)
    out = []
    for i, p in enumerate(passages(llm.engine.tokenizer, n, length)):
        task = COPY_TASKS[i % len(COPY_TASKS)]
        out.append(_chat(llm, f"{task}\n\n{misspell(p, rng) if task.startswith('Correct') else p}"))
    return out


def grounded_prompts(llm, n: int, length: int) -> list[list[int]]:
    return [_chat(llm, f"{GROUNDED_TASKS[i % 2]}\n\n{p}")
            for i, p in enumerate(passages(llm.engine.tokenizer, n, length, offset=4000))]


def agent_prompts(llm, n: int) -> list[list[int]]:
    """``n`` turns of one agent loop: the same conversation shape, other cities, people and times."""
    rng = random.Random(2)
    system = ("You are a travel assistant. You can call these tools; answer with one JSON object "
              '{"name": ..., "arguments": {...}} to call a tool, then summarise its result for the user.\n'
              + json.dumps(TOOLS, indent=1))
    out = []
    for i in range(n):
        city, people, hour = CITIES[i % len(CITIES)], rng.randrange(2, 7), rng.randrange(18, 22)
        weather = {"city": city, "temperature": rng.randrange(5, 30), "unit": "C", "sky": rng.choice(["sunny", "rain"])}
        msgs = [{"role": "system", "content": system},
                {"role": "user", "content": f"What is the weather in {city}? Then book a table for {people} "
                                            f"at {hour}:00."},
                {"role": "assistant", "content": json.dumps({"name": "get_weather",
                                                             "arguments": {"city": city, "unit": "C"}})},
                {"role": "user", "content": "Tool result: " + json.dumps(weather) + "\nNow call book_table, "
                                            "then tell me the weather and the booking in two sentences."}]
        out.append(llm.apply_chat_template(msgs))
    return out


def chat_prompts(llm, n: int) -> list[list[int]]:
    return [_chat(llm, CHAT[i % len(CHAT)]) for i in range(n)]
