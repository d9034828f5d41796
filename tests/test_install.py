"""The installer derives the backports source from the machine's own apt sources (no host names in the repo)."""

import pytest

from ebrl.install import InstallError, backports_entry, parse_deb822, parse_one_line, read_apt_sources

DEB822 = """\
Types: deb
# a comment
URIs: http://mirror.example/debian
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: http://mirror.example/debian-security
Suites: bookworm-security
Components: main

Enabled: no
Types: deb
URIs: http://disabled.example/debian
Suites: bookworm-backports
Components: main
"""


def test_backports_entry_from_deb822_sources():
    sources = parse_deb822(DEB822)
    assert len(sources) == 2  # the disabled paragraph is skipped
    entry = backports_entry(sources, "bookworm")
    assert entry.splitlines() == [
        "Types: deb",
        "URIs: http://mirror.example/debian",
        "Suites: bookworm-backports",
        "Components: main",
        "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg",
    ]


def test_backports_entry_from_one_line_sources():
    text = (
        "deb [arch=amd64 signed-by=/k.gpg] http://mirror.example/debian bookworm main contrib  # comment\n"
        "deb-src http://mirror.example/debian bookworm main\n"
    )
    entry = backports_entry(parse_one_line(text), "bookworm")
    assert "URIs: http://mirror.example/debian\n" in entry and "Signed-By: /k.gpg" in entry


def test_existing_backports_or_no_release_source():
    text = "deb http://m.example/debian bookworm main\ndeb http://m.example/debian bookworm-backports main\n"
    assert backports_entry(parse_one_line(text), "bookworm") is None
    with pytest.raises(InstallError, match="no apt source serves 'trixie main'"):
        backports_entry(parse_one_line(text), "trixie")


def test_reads_both_file_formats(tmp_path):
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text("deb http://a.example/debian bookworm main\n")
    (tmp_path / "sources.list.d" / "x.sources").write_text(DEB822)
    (tmp_path / "sources.list.d" / "y.list.disabled").write_text("deb http://b.example/x nodistro main\n")
    uris = [s.uris[0] for s in read_apt_sources(tmp_path)]
    assert uris == ["http://a.example/debian", "http://mirror.example/debian", "http://mirror.example/debian-security"]
