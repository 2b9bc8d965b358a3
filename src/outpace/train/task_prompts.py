"""Prompts that hand the target a text to work on, built from its own answers.

A file of questions (the training prompts' file is chain-of-thought questions, code and
role-play) and the prompts the target writes itself (self_prompts.py) are short: a head trained
on the answers to them never reads a long context, nor an answer that copies from one. Users ask
for that too: to summarize an article, to answer from retrieved passages, to pull facts out of a
text, to translate. Such prompts are built here from the target's answers to the first set (the
documents) and the questions they answered, each kind of task from a few plain phrasings:
  - summary: one to four answers as one text, and a request to summarize it;
  - extraction: an answer or two, and a request for a list, a table or JSON of what it holds;
  - passages: three or four answers as numbered passages, and the question one of them answered;
  - translation there and back: a conversation of two turns, an answer's first sentences to
    translate into another language, then the target's translation back into English;
  - follow-up: a conversation of two turns, a question, then a request to rework the answer.
The same documents, count and seed give the same prompts.
"""
from __future__ import annotations

import random
import re

from outpace.errors import InvalidParameterError

SUMMARY = ("Summarize the following text.", "Write a short summary of the text below.",
           "Summarize this in a few sentences:", "What are the main points of this text? Answer briefly.",
           "Give a one-paragraph summary:", "Summarize:")
EXTRACTION = ("Read the text below and list its key facts as bullet points.",
              "Extract every number in the text below together with what it refers to.",
              "List the people, places, objects and terms the following text mentions.",
              "Put the steps or claims of the text below into a table with one row each.",
              "Return a JSON object with the main topic of this text and a list of its key points.",
              "Which questions does the following text answer? List them, each with its answer in one line.")
PASSAGES = ("Answer the question using the passages below.", "Use the following documents to answer the question.",
            "Here are some search results. Answer the question from them, citing the passage numbers.",
            "Based only on the context below, answer the question at the end.")
LANGUAGES = ("German", "French", "Spanish", "Italian", "Portuguese", "Dutch")
FOLLOW_UPS = ("Rewrite your answer in half as many words.", "Explain your answer to a ten-year-old.",
              "Give a concrete example of this.", "Now turn your answer into a short poem.",
              "What are the weak points of your answer? Improve it.", "Summarize your answer in three bullet points.",
              "Rewrite your answer as a formal email.", "Can you say the same thing without any technical terms?")
KINDS = ("summary", "extraction", "passages", "translation", "follow_up")
WEIGHTS = (3, 2, 2, 2, 1)
MIN_DOC_CHARS = 200         # an answer shorter than this is too slight to work on
SUMMARY_CHARS = (1500, 4500)  # a summary's text: answers joined until it reaches a length drawn from this range
PASSAGE_CHARS = 900         # a passage is an answer cut to about this many characters (at a sentence's end)
SENTENCE = re.compile(r"(?<=[.!?])\s+")


def task_prompts(pairs: list[tuple[str, str]], count: int, seed: int) -> list[str | list[str]]:
    """`count` prompts (a string, or a conversation's user turns) from (question, answer) pairs:
    the answers are the documents, the questions what the passages task asks."""
    docs = [(q, a.strip()) for q, a in pairs if len(a.strip()) >= MIN_DOC_CHARS]
    if len(docs) < 4:
        raise InvalidParameterError(f"task prompts need at least 4 answers of {MIN_DOC_CHARS} characters or more, "
                                    f"and {len(docs)} of {len(pairs)} are: answer more prompts or raise --max-tokens")
    rng = random.Random(seed)
    return [_build(rng.choices(KINDS, WEIGHTS)[0], docs, rng) for _ in range(count)]


def _build(kind: str, docs: list[tuple[str, str]], rng: random.Random) -> str | list[str]:
    if kind == "summary":
        goal, parts = rng.randint(*SUMMARY_CHARS), []
        while sum(map(len, parts)) < goal and len(parts) < 4:
            parts.append(rng.choice(docs)[1])
        return f"{rng.choice(SUMMARY)}\n\n" + "\n\n".join(parts)
    if kind == "extraction":
        text = "\n\n".join(d[1] for d in rng.sample(docs, rng.randint(1, 2)))
        return f"{rng.choice(EXTRACTION)}\n\n{text}"
    if kind == "passages":
        chosen = rng.sample(docs, rng.randint(3, 4))
        passages = "\n\n".join(f"[{i + 1}] {_cut(a, PASSAGE_CHARS)}" for i, (_, a) in enumerate(chosen))
        return f"{rng.choice(PASSAGES)}\n\n{passages}\n\nQuestion: {rng.choice(chosen)[0]}"
    if kind == "translation":
        language = rng.choice(LANGUAGES)
        text = " ".join(SENTENCE.split(rng.choice(docs)[1])[:rng.randint(1, 3)])
        return [f"Translate into {language}:\n\n{text}", f"Now translate your {language} text back into English."]
    question = rng.choice(docs)[0]
    return [question, rng.choice(FOLLOW_UPS)]


def _cut(text: str, chars: int) -> str:
    """text up to the end of the sentence that passes `chars` characters."""
    if len(text) <= chars:
        return text
    end = SENTENCE.search(text, chars)
    return text[:end.start()] if end else text
