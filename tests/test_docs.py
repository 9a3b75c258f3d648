"""The docs: every relative link and #anchor in README.md, CHANGELOG.md, benchmarks/RESULTS.md
and docs/*.md resolves (anchors as GitHub slugs its headings), and docs/cli.md names every
subcommand and every flag `pstranspile`'s parser defines, each in its subcommand's section (a
flag every subcommand takes, such as `-q`, once, in the section "Options every command
takes")."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
from conftest import TESTS

from transpiler.cli import build_parser

REPO = TESTS.parent
PAGES = sorted([REPO / "README.md", REPO / "CHANGELOG.md", REPO / "benchmarks" / "RESULTS.md",
                *(REPO / "docs").glob("*.md")])
CLI_REFERENCE = REPO / "docs" / "cli.md"

FENCE = re.compile(r"^\s*(```|~~~)")
# [text](target) or [text](target "title"); not an image's or a reference-style link's.
LINK = re.compile(r"(?<!!)\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+).*?\1")


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if match:
            if fenced is None:
                fenced = match.group(1)
            elif match.group(1) == fenced:
                fenced = None
            continue
        if fenced is None:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: its text (markup dropped) lower-cased, every character
    but letters, digits, `_`, `-` and spaces dropped, spaces turned into `-`."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = "".join(c for c in text.strip().lower() if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor of a page's headings, duplicates numbered `-1`, `-2`, ... as GitHub does."""
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose_lines(page.read_text()):
        match = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[tuple[int, str]]:
    out = []
    for number, line in prose_lines(page.read_text()):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            out.append((number, target))
    return out


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: {path_part} does not exist")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"{where}: no heading of {dest.relative_to(root)} has the anchor #{anchor}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_and_anchor_resolves(page):
    assert page.exists()
    assert broken_links(page) == []


def test_the_pages_link_to_each_other():
    """The link check above has something to check: each page has links, and every page of
    docs/ is reachable from docs/index.md."""
    index = {(REPO / "docs" / target.partition("#")[0]).resolve() for _, target in links(REPO / "docs" / "index.md")}
    assert {page.resolve() for page in (REPO / "docs").glob("*.md")} - {(REPO / "docs" / "index.md").resolve()} <= index
    assert all(links(page) for page in PAGES)


def test_the_link_checker_finds_broken_links_and_anchors(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other page\n\n## Fluid 1.8 vs `Paddle` 2.6\n\n## Proof\n\n## Proof\n")
    page.write_text(
        "# Title\n\n[ok](other.md#fluid-18-vs-paddle-26) [ok](other.md#proof-1) [ok](#title)\n"
        "[bad](missing.md) [bad](other.md#nowhere) [bad](#untitled) [ext](https://example.com/x#y)\n"
        "`[not a link](nowhere.md)`\n\n```\n[not a link](nowhere.md)\n# not a heading\n```\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 2)[1] for p in problems] == ["missing.md", "other.md#nowhere", "#untitled"]


def test_slugs_are_github_s():
    assert slug("Transpiling: the Python API") == "transpiling-the-python-api"
    assert slug("Building programs (`transpiler.frontend`)") == "building-programs-transpilerfrontend"
    assert slug("`pstranspile merge-table`") == "pstranspile-merge-table"
    assert slug("gRPC's I/O engine") == "grpcs-io-engine"
    assert slug("Side by side with Fluid 1.8.5") == "side-by-side-with-fluid-185"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def flags(parser: argparse.ArgumentParser) -> list[str]:
    return [flag for action in parser._actions if not isinstance(action, argparse._HelpAction)
            for flag in action.option_strings]


COMMON_HEADING = "Options every command takes"


def sections(text: str) -> dict[str, str]:
    """docs/cli.md's `## `pstranspile NAME`` sections, by NAME."""
    parts = re.split(r"^## `pstranspile ([a-z0-9-]+)`\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1].split("\n## ", 1)[0] for i in range(1, len(parts), 2)}


def common_section(text: str) -> str:
    """docs/cli.md's `## Options every command takes` section ("" when it has none)."""
    parts = re.split(rf"^## {re.escape(COMMON_HEADING)}\s*$", text, maxsplit=1, flags=re.M)
    return parts[1].split("\n## ", 1)[0] if len(parts) == 2 else ""


def mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def common_flags(commands: dict[str, argparse.ArgumentParser]) -> list[str]:
    """The flags every subcommand defines, in the first subcommand's order."""
    first, *rest = commands.values()
    return [flag for flag in flags(first) if all(flag in flags(parser) for parser in rest)]


def undocumented(text: str, commands: dict[str, argparse.ArgumentParser]) -> dict[str, list[str]]:
    """The flags the reference `text` leaves out, by the section that should name them: a
    subcommand's own flags in its `pstranspile NAME` section, the flags every subcommand
    takes in the common section (or, failing that, in every subcommand's section)."""
    documented, common = sections(text), common_section(text)
    shared = common_flags(commands) if len(commands) > 1 else []
    missing = {COMMON_HEADING: [flag for flag in shared if not mentions(common, flag)]} if common else {}
    for name, parser in commands.items():
        section = documented.get(name, "")
        wanted = [flag for flag in flags(parser) if not (common and flag in shared)]
        missing[name] = [flag for flag in wanted if not mentions(section, flag)]
    return {where: found for where, found in missing.items() if found}


def test_the_cli_reference_has_a_section_for_every_subcommand():
    documented = sections(CLI_REFERENCE.read_text())
    assert sorted(subcommands()) == sorted(documented)
    assert len(documented) >= 10


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_flag_of_a_subcommand_is_in_its_section_of_the_cli_reference(name):
    missing = undocumented(CLI_REFERENCE.read_text(), subcommands())
    assert missing.get(name, []) == []


def test_the_flags_every_command_takes_are_in_the_cli_reference():
    """`-q`, `--full`: once, in the common section (each subcommand's own flags are above)."""
    text = CLI_REFERENCE.read_text()
    assert common_section(text) and common_flags(subcommands())
    assert undocumented(text, subcommands()).get(COMMON_HEADING, []) == []


def test_the_flag_check_finds_an_undocumented_flag():
    """The check above can fail: a flag left out of its section, or of the common section, is
    found; without a common section a shared flag must be in every subcommand's section."""
    def parser(*own: str) -> argparse.ArgumentParser:
        p = argparse.ArgumentParser()
        for flag in (*own, "-q", "--full"):
            p.add_argument(flag, action="store_true")
        return p

    commands = {"a": parser("--alpha"), "b": parser("--beta", "--gamma")}
    ref = ("## `pstranspile a`\n\n`--alpha`, `--gamma` (b's)\n\n## `pstranspile b`\n\n`--beta`\n\n"
           f"## {COMMON_HEADING}\n\n`-q`, `--fully`\n\n## Exit codes\n\n`--full`\n")
    assert undocumented(ref, commands) == {COMMON_HEADING: ["--full"], "b": ["--gamma"]}
    assert undocumented(ref.replace("--fully", "--full").replace("`--beta`", "`--beta`, `--gamma`"), commands) == {}
    without_common = ref.split(f"## {COMMON_HEADING}")[0]
    assert undocumented(without_common, commands) == {
        "a": ["-q", "--full"], "b": ["--gamma", "-q", "--full"]}


def test_the_top_level_flags_are_in_the_cli_reference():
    parser = build_parser()
    text = CLI_REFERENCE.read_text()
    assert [flag for flag in flags(parser) if not mentions(text, flag)] == []


def test_the_readme_is_a_page_for_users():
    """At most ~250 lines: reference detail lives in docs/, history in CHANGELOG.md."""
    assert len((REPO / "README.md").read_text().splitlines()) <= 250


def test_the_readme_transpile_snippet_runs(tmp_path, monkeypatch):
    """The README's Python example (the first ```python block) on a Paddle-built program."""
    import shutil

    block = re.search(r"```python\n(.*?)```", (REPO / "README.md").read_text(), re.S).group(1)
    assert "transpile(" in block
    for name in ("main.pb", "startup.pb"):
        shutil.copy(TESTS / "fixtures" / "paddle_programs" / "mlp_adam_2ps" / name, tmp_path / name)
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "plan.json", "pserver_10.0.0.1_6170.pb", "pserver_10.0.0.1_6170_startup.pb", "pserver_10.0.0.2_6170.pb",
        "pserver_10.0.0.2_6170_startup.pb", "trainer.pb", "trainer_startup.pb"]
    assert scope["result"].plan.to_json()


def command_lines(page: Path) -> list[tuple[int, list[str]]]:
    """The `pstranspile SUBCOMMAND ...` commands in a page's code blocks, as tokens after
    `pstranspile` (continuation lines joined; up to a lone `--`, a pipe or a comment)."""
    out, fenced, pending = [], False, ""
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced, pending = not fenced, ""
            continue
        if not fenced:
            continue
        line = pending + line
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1] + " "
            continue
        pending = ""
        match = re.search(r"(?:^|[\s;&(])pstranspile\s+(.*)$", re.sub(r"(^|\s)#.*$", "", line))
        if not match or match.group(1).startswith("COMMAND"):  # `pstranspile COMMAND --help`
            continue
        tokens = []
        for token in match.group(1).split():
            if token in ("--", "|") or token.startswith("#"):
                break
            tokens.append(token)
        out.append((number, tokens))
    return out


def test_the_commands_in_the_docs_use_flags_pstranspile_has():
    """Every flag of every `pstranspile ...` example in a code block is one its subcommand
    defines: an example cannot drift from the parser."""
    commands = subcommands()
    problems, checked = [], 0
    for page in PAGES:
        for number, tokens in command_lines(page):
            where = f"{page.relative_to(REPO)}:{number}"
            if tokens and tokens[0].startswith("-"):
                known = [*flags(build_parser()), "-h", "--help"]
                name = None
            elif tokens and tokens[0] in commands:
                name, tokens = tokens[0], tokens[1:]
                known = [*flags(commands[name]), "-h", "--help"]
            else:
                problems.append(f"{where}: unknown subcommand in `pstranspile {' '.join(tokens)}`")
                continue
            for token in tokens:
                flag = token.strip("[]()").split("=", 1)[0]
                if flag.startswith("-") and flag not in ("-", "..."):
                    checked += 1
                    if flag not in known:
                        problems.append(f"{where}: pstranspile {name or ''} has no {flag}")
    assert problems == []
    assert checked > 50
