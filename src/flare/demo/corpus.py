"""The demo model's training text: documentation that ships with every CPython installation.

Two sources, both read offline and in a fixed order so that a build is reproducible:
the reference-manual topics in `pydoc_data.topics` (what `help("if")` shows), and the docstrings of
a fixed list of standard-library modules and their public classes, functions and methods.
From these we also derive short chat exchanges ("What is X?" answered by the first sentences of
X's documentation), so that chat-style prompts lead somewhere sensible.
"""

from __future__ import annotations

import importlib
import inspect
import json
import random
import re
import subprocess
import sys
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

# Well-known, side-effect-free modules in the order they are read. A fixed list (rather than every
# stdlib module) keeps the build deterministic and avoids imports with effects (antigravity, this,
# tkinter); a module missing from this Python build is skipped.
STDLIB_MODULES = (
    "builtins", "abc", "argparse", "array", "ast", "asyncio", "base64", "bisect", "bz2", "calendar",
    "cmath", "codecs", "collections", "collections.abc", "colorsys", "configparser", "contextlib",
    "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis", "email.message", "enum",
    "filecmp", "fnmatch", "fractions", "functools", "gc", "getopt", "gettext", "glob", "gzip",
    "hashlib", "heapq", "hmac", "html", "html.parser", "http", "http.client", "http.server",
    "importlib", "inspect", "io", "ipaddress", "itertools", "json", "keyword", "linecache", "locale",
    "logging", "lzma", "math", "mimetypes", "operator", "os", "os.path", "pathlib", "pickle",
    "pkgutil", "platform", "pprint", "queue", "random", "re", "reprlib", "sched", "secrets",
    "selectors", "shelve", "shlex", "shutil", "signal", "socket", "sqlite3", "statistics", "string",
    "struct", "subprocess", "sys", "tarfile", "tempfile", "textwrap", "threading", "time", "timeit",
    "token", "tokenize", "traceback", "types", "typing", "unicodedata", "unittest", "urllib.parse",
    "urllib.request", "uuid", "warnings", "weakref", "xml.etree.ElementTree", "zipfile", "zlib",
)

# Builtin types that read naturally with an article ("What is a list?").
_ARTICLE_TYPES = {
    "bool", "bytearray", "bytes", "classmethod", "complex", "dict", "float", "frozenset", "int",
    "list", "memoryview", "object", "property", "range", "set", "slice", "staticmethod", "str",
    "tuple", "type",
}

SYSTEM_PROMPT = "You are a small demo model trained on the Python documentation."

# Hand-written exchanges so the model says plainly what it is when asked.
_IDENTITY_ANSWER = (
    "I am a small demo model, trained for a few minutes on the Python documentation. "
    "I imitate that text; my replies are not reliable answers."
)
_IDENTITY_QUESTIONS = ("Who are you?", "What are you?", "Hello!", "Hi", "Are you an assistant?")

_QUESTION_FORMS = ("What is {}?", "Tell me about {}.", "Explain {}.", "What does the documentation say about {}?")
_FUNCTION_QUESTION_FORMS = ("What does {}() do?", "What is {}()?", "Explain {}().", "How do I use {}()?")


@dataclass(frozen=True)
class Document:
    """One piece of documentation: `subject` names what it documents, `text` is the documentation."""

    subject: str
    text: str
    kind: str  # "topic", "module", "class" or "function"


def collect_documents() -> list[Document]:
    """Every document of the corpus, reference topics first, each distinct text once.

    Read in a fresh interpreter that imports only the standard library: libraries loaded in this
    process patch standard modules (transformers adds methods to `logging.Logger`, torch replaces
    `inspect.getfile`), which would change the text and so the model.
    """
    command = [sys.executable, "-I", "-S", str(Path(__file__).resolve())]
    result = subprocess.run(command, capture_output=True)
    if result.returncode != 0:
        from flare.errors import PreparationError  # not at the top: this file also runs without flare

        raise PreparationError(
            "could not read the Python documentation for the demo model: "
            + result.stderr.decode(errors="replace").strip()[-500:]
        )
    return [Document(**fields) for fields in json.loads(result.stdout)]


def _collect_in_this_interpreter() -> list[Document]:
    documents = _topic_documents() + _docstring_documents()
    seen: set[str] = set()
    unique = []
    for document in documents:
        if document.text not in seen:
            seen.add(document.text)
            unique.append(document)
    return unique


def split_held_out(documents: list[Document], every: int = 40) -> tuple[list[Document], list[Document]]:
    """Split into (training, held-out): every `every`-th document is held out to measure learning."""
    training = [d for i, d in enumerate(documents) if i % every != every - 1]
    held_out = [d for i, d in enumerate(documents) if i % every == every - 1]
    return training, held_out


def training_texts(documents: list[Document], seed: int) -> list[str]:
    """The texts the model trains on: each document, and each chat exchange rendered with the chat
    template, in one seeded shuffled order."""
    from flare.demo.tokenizer import render_chat

    texts = [document_text(d) for d in documents]
    texts += [render_chat(messages) for messages in chat_exchanges(documents, seed)]
    random.Random(seed).shuffle(texts)
    return texts


def document_text(document: Document) -> str:
    """The text the model reads for a document: its subject as a heading, then the documentation."""
    if document.kind == "topic":
        return document.text  # topics already begin with their own underlined title
    return f"{document.subject}\n\n{document.text}"


def chat_exchanges(documents: list[Document], seed: int) -> list[list[dict[str, str]]]:
    """Short question/answer conversations derived from the documents (plus a few about the model).

    The answer is the first sentences of the document; about one conversation in four carries the
    system prompt, so prompts with and without one both look familiar to the model.
    """
    rng = random.Random(seed)
    conversations = []
    for document in documents:
        answer = first_sentences(document.text)
        if not answer or not _worth_asking_about(document):
            continue
        for question in _questions(document, rng):
            conversations.append(_conversation(question, answer, rng))
    for question in _IDENTITY_QUESTIONS:
        for _ in range(10):
            conversations.append(_conversation(question, _IDENTITY_ANSWER, rng))
    rng.shuffle(conversations)
    return conversations


def first_sentences(text: str, limit: int = 320) -> str:
    """The opening prose of a document: its first paragraph of running text, cut at a sentence end."""
    for paragraph in _prose_paragraphs(text):
        sentences = re.split(r"(?<=[.!?])\s+", paragraph)
        answer = sentences[0]
        for sentence in sentences[1:]:
            if len(answer) + 1 + len(sentence) > limit:
                break
            answer = f"{answer} {sentence}"
        return answer if len(answer) <= 2 * limit else ""
    return ""


def _conversation(question: str, answer: str, rng: random.Random) -> list[dict[str, str]]:
    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    if rng.random() < 0.25:
        messages.insert(0, {"role": "system", "content": SYSTEM_PROMPT})
    return messages


def _worth_asking_about(document: Document) -> bool:
    """Topics, modules, classes and builtins. Methods and module functions stay plain text only:
    they are most of the documents and nearly all begin "Return ...", which would make every
    answer begin that way."""
    return document.kind != "function" or document.subject.startswith("builtins.")


def _questions(document: Document, rng: random.Random) -> list[str]:
    """One or two phrasings of "what is this?" for a document."""
    subject = document.subject
    if document.kind == "function":
        forms = _FUNCTION_QUESTION_FORMS
    elif document.kind == "module":
        forms, subject = _QUESTION_FORMS, f"the {subject} module"
    else:
        forms = _QUESTION_FORMS
    subjects = [subject]
    short_name = subject.removeprefix("builtins.")
    if short_name in _ARTICLE_TYPES:
        subjects = [f"a {short_name}", short_name]
    elif short_name != subject:
        subjects = [short_name]
    return [rng.choice(forms).format(s) for s in subjects]


def _prose_paragraphs(text: str):
    """Paragraphs of running text, skipping titles, underlines, grammar and indented examples."""
    for block in re.split(r"\n\s*\n", text):
        lines = block.splitlines()
        if not lines or lines[0].startswith((" ", "\t")) or "::=" in block or ">>>" in block:
            continue
        if len(lines) >= 2 and set(lines[-1]) <= set("*=-~^"):
            continue  # a heading with its underline
        paragraph = " ".join(line.strip() for line in lines)
        if len(paragraph) >= 20 and paragraph[-1] in ".:!?)":
            yield paragraph.rstrip(":") + ("" if paragraph.endswith((".", "!", "?", ")")) else ".")


def _topic_documents() -> list[Document]:
    from pydoc_data.topics import topics

    documents = []
    for key in sorted(topics):
        text = topics[key].strip()
        title = text.splitlines()[0].strip()
        documents.append(Document(subject=title, text=text, kind="topic"))
    return documents


def _docstring_documents() -> list[Document]:
    documents = []
    for module_name in STDLIB_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # e.g. reading typing.io warns
            documents.extend(_module_documents(module_name, module))
    return documents


def _module_documents(module_name: str, module) -> list[Document]:
    documents = []
    doc = inspect.getdoc(module)
    if doc:
        documents.append(Document(subject=module_name, text=doc, kind="module"))
    for name in sorted(vars(module)):
        obj = vars(module)[name]
        if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
            continue  # private, or re-exported from another module
        if inspect.isclass(obj):
            documents.extend(_class_documents(f"{module_name}.{name}", obj))
        elif callable(obj):
            documents.extend(_own_doc(f"{module_name}.{name}", obj, "function"))
    return documents


def _class_documents(qualified_name: str, cls) -> list[Document]:
    documents = _own_doc(qualified_name, cls, "class")
    for name in sorted(vars(cls)):
        member = vars(cls)[name]
        if not name.startswith("_") and callable(member):
            documents.extend(_own_doc(f"{qualified_name}.{name}", member, "function"))
    return documents


def _own_doc(subject: str, obj, kind: str) -> list[Document]:
    """The object's own docstring (not one inherited from a base class), cleaned of indentation."""
    raw = getattr(obj, "__doc__", None)
    if not isinstance(raw, str) or not raw.strip():
        return []
    return [Document(subject=subject, text=inspect.cleandoc(raw), kind=kind)]


if __name__ == "__main__":  # run by collect_documents() in a fresh interpreter; writes ASCII JSON
    sys.stdout.write(json.dumps([asdict(d) for d in _collect_in_this_interpreter()]))
