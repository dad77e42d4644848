"""The README is a short front door and every link in README.md and docs/ resolves.

Links are checked as GitHub renders them: a relative path must name a file or directory of the checkout, and an
anchor (``#...``) must be the slug of a heading of the target page (GitHub's rule: lower case, punctuation other
than ``-`` and ``_`` dropped, spaces to ``-``, a repeated slug gets ``-1``, ``-2``, ...). The README's shell
snippets name commands whose arguments the CLI accepts and whose run-config keys and values are valid.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def _headings(page: Path) -> list[str]:
    """Heading texts as written (inline code included), outside fenced blocks."""
    out, fenced = [], False
    for line in page.read_text().split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.*?)\s*$", line)):
            out.append(m.group(1))
    return out


def github_slugs(page: Path) -> set[str]:
    found: set[str] = set()
    seen: dict[str, int] = {}
    for heading in _headings(page):
        base = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_github_slugs_follow_githubs_rule(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("# Local data on the device (`data-path`)\n## Differences from Flower's FedAvg\n## A\n## A\n"
                    "```\n# not a heading\n```\n")
    assert github_slugs(page) == {"local-data-on-the-device-data-path", "differences-from-flowers-fedavg", "a", "a-1"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_resolves_to_a_file_or_an_anchor(page: Path) -> None:
    broken = []
    for target in LINK.findall(_prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https://, mailto: ...: outside the checkout
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in github_slugs(dest)):
            broken.append(f"{target}: no heading with that anchor in {dest.relative_to(ROOT)}")
    assert not broken, broken


def test_every_docs_page_is_reachable_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall(_prose((ROOT / "README.md").read_text()))}
    unlinked = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_the_readme_is_a_front_door_in_the_agreed_order() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    sections = [h for h in _headings(ROOT / "README.md") if not h.startswith("fedpdm-flower")]
    top = [h for h in sections if f"## {h}" in text.split("\n")]
    assert top == ["Which piece do I need", "Install it into your own Flower app", "One snippet per route",
                   "The two commands", "Differences from Flower's FedAvg that remain", "Documentation", "License"]


def test_user_facing_text_uses_no_internal_project_words() -> None:
    """Papers are named by title and authors; the project's seed numbers, issue numbers and spec sections are not
    something a reader has."""
    pattern = re.compile(r"\bseed[- ]00[0-4]\b|\bissue \d+\b|\bspec (section )?[0-9A][0-9.]*\b|\bthe spec\b")
    hits = {p.name: pattern.findall(p.read_text()) for p in PAGES}
    assert not {k: v for k, v in hits.items() if v}, hits


def _snippet_commands(marker: str) -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    after = text[text.index(marker) + len(marker):]
    match = re.match(r"\s*```bash\n(.*?)```", after, re.DOTALL)
    assert match, f"{marker} must be followed by a bash block"
    lines = [line.split("#", 1)[0].strip() for line in match.group(1).splitlines()]
    return [shlex.split(line) for line in lines if line]


def test_the_readmes_deploy_snippet_is_a_valid_command() -> None:
    from fedpdm_flower.fedapp.config import parse_run_config
    from simulations.deploy import build_parser

    (cmd,) = _snippet_commands("<!-- snippet: deploy -->")
    assert cmd[:3] == ["python", "-m", "simulations.deploy"]
    args = build_parser().parse_args(cmd[3:])
    assert not args.insecure  # the front door's command is the secure default
    parse_run_config(dict(kv.split("=", 1) for kv in args.overrides))


def test_the_readmes_reproduction_snippet_names_valid_commands() -> None:
    from fedpdm_flower.fedapp.config import parse_run_config
    from simulations.__main__ import build_parser
    from simulations.experiments import FIGURES

    cmds = _snippet_commands("<!-- snippet: reproduce -->")
    assert cmds and all(c[:3] == ["python", "-m", "simulations"] for c in cmds)
    for cmd in cmds:
        args = build_parser().parse_args(cmd[3:])
        if args.command == "run":
            parse_run_config({"algorithm": args.algorithm, **dict(kv.split("=", 1) for kv in args.set or [])})
        if args.command == "figure":
            assert args.name in FIGURES
