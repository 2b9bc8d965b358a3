"""Task prompts built from the target's answers (train/task_prompts.py): each kind holds the
documents it names verbatim, conversations have their two turns, and the seed fixes them."""
import pytest

from outpace.errors import InvalidParameterError
from outpace.train.task_prompts import LANGUAGES, task_prompts


def pairs(n=12):
    return [(f"Question {i}?", " ".join(f"Sentence {j} of answer {i} says something." for j in range(12)))
            for i in range(n)]


def test_each_kind_holds_its_documents_and_questions():
    docs = pairs()
    answers = {a for _, a in docs}
    questions = {q for q, _ in docs}
    prompts = task_prompts(docs, 300, seed=0)
    kinds = {"summary": 0, "extraction": 0, "passages": 0, "translation": 0, "follow_up": 0}
    for p in prompts:
        if isinstance(p, list):
            assert len(p) == 2
            if p[0] in questions:                                   # a follow-up on a question
                kinds["follow_up"] += 1
                continue
            language = next(x for x in LANGUAGES if p[0].startswith(f"Translate into {x}:"))
            sentences = p[0].split("\n\n", 1)[1]
            assert any(a.startswith(sentences) for a in answers) and language in p[1]
            kinds["translation"] += 1
        elif "\nQuestion: " in p:
            body, question = p.rsplit("\nQuestion: ", 1)
            passages = [part.split("] ", 1)[1].strip() for part in body.split("\n\n")[1:] if part.startswith("[")]
            assert 3 <= len(passages) <= 4 and question in questions
            owner = next(a for q, a in docs if q == question)
            assert any(owner.startswith(x) for x in passages)          # the question's own answer is among them
            kinds["passages"] += 1
        else:
            parts = p.split("\n\n")[1:]
            assert parts and all(x in answers for x in parts)
            kinds["summary" if len(parts) > 2 or "ummar" in p.split("\n\n")[0] else "extraction"] += 1
    assert all(kinds.values()), kinds


def test_the_seed_fixes_the_prompts():
    assert task_prompts(pairs(), 40, seed=1) == task_prompts(pairs(), 40, seed=1) != task_prompts(pairs(), 40, seed=2)


def test_too_few_answers_of_substance_are_refused():
    short = [(f"q{i}", "Yes.") for i in range(50)]
    with pytest.raises(InvalidParameterError, match="at least 4 answers"):
        task_prompts(short + pairs(3), 5, seed=0)
