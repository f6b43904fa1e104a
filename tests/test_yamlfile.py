"""The YAML reader shared by queue files, agent-host.yaml and simulation traces."""

import pytest

from testflinger_magic import yamlfile


def test_values_and_lines():
    data, lines = yamlfile.parse("a:\n  b: [1, 2]\n  c: x\n")
    assert data == {"a": {"b": [1, 2], "c": "x"}}
    assert lines[("a", "b")] == 2 and lines[("a", "c")] == 3 and lines[("a", "b", 1)] == 2
    assert yamlfile.line_for(lines, ("a", "c", "missing")) == 3
    assert yamlfile.parse("") == (None, {})


@pytest.mark.parametrize("text, line, field, words", [
    ("a: 1\nb: 2\na: 3\n", 3, "a", "duplicated key 'a' (first on line 1)"),
    ("a: &x 1\nb: *x\n", 1, "", "anchor '&x' is not allowed: do it by hand"),
    ("a: {<<: {b: 1}}\n", 1, "a", "merge key '<<' is not allowed: do it by hand"),
    ("a: [1\n", 2, "", "YAML syntax error"),
    ("a: " + "[" * 5000 + "]" * 5000 + "\n", 1, "", f"nested deeper than {yamlfile.MAX_DEPTH}"),
])
def test_problems_name_line_and_field(text, line, field, words):
    with pytest.raises(yamlfile.YamlProblem) as err:
        yamlfile.parse(text, hint="do it by hand")
    assert (err.value.line, err.value.field) == (line, field)
    assert words in err.value.message


@pytest.mark.parametrize("text, line, hint", [
    ("a:\n  b: 1\n c: 2\n", 3, "check the indentation of this line"),
    ("a: {b: 1 c: 2}\n", 1, "check the commas and braces of the { } mapping"),
    ("a: [1, 2\nb: 3\n", 2, "check the commas and brackets of the [ ] list opened on or before"),
    ("a: b: c\n", 1, "a value holding ': ' must be quoted"),
    ("a: 'x\n", 2, "a quote or bracket opened on or before this line is never closed"),
])
def test_a_syntax_error_says_what_to_check(text, line, hint):
    """TRIAL9 F3: PyYAML's own words ("expected <block end>, but found '<block mapping
    start>'") said where, not what to look at."""
    with pytest.raises(yamlfile.YamlProblem) as err:
        yamlfile.parse(text)
    assert err.value.line == line
    assert err.value.message.startswith("YAML syntax error: ") and f"({hint}" in err.value.message


LONG_KEY = "a key is at most 1024 characters: PyYAML does not read a longer one as a key"


@pytest.mark.parametrize("text, line, hint", [
    ("magic_queues:\n  " + "q" * 1025 + ":\n    description: x\n", 2, LONG_KEY),
    ("- " + "k" * 1030 + ": v\n", 1, LONG_KEY),
    ("'" + "k" * 1030 + "': v\n", 1, LONG_KEY),
    ("a: {" + "k" * 1030 + ": v}\n", 1, LONG_KEY),
    # a long value holding ': ' is not a long key
    ("a: " + "x" * 2000 + ": y\n", 1, "a value holding ': ' must be quoted"),
])
def test_a_key_longer_than_pyyaml_takes_says_so(text, line, hint):
    """TRIAL12 F6: a 1025-character queue name got the quoting/indentation hint; PyYAML takes
    no implicit key longer than 1024 characters (the 1024-character one is read)."""
    with pytest.raises(yamlfile.YamlProblem) as err:
        yamlfile.parse(text)
    assert err.value.line == line and f"({hint}" in err.value.message
    assert yamlfile.parse("k" * 1024 + ": x\n")[0] == {"k" * 1024: "x"}


def test_aliases_when_allowed_but_never_merge_keys():
    data, _ = yamlfile.parse("a: &x [1]\nb: *x\n", aliases=True)
    assert data == {"a": [1], "b": [1]}
    with pytest.raises(yamlfile.YamlProblem, match="merge key"):
        yamlfile.parse("a: &x {c: 1}\nb: {<<: *x}\n", aliases=True)


@pytest.mark.parametrize("text, kind", [
    ("a:\n  b: 0x10\n", "hexadecimal"), ("a:\n  b: 0b101\n", "binary"),
    ("a:\n  b: 010\n", "octal"), ("a:\n  b: 10_000\n", "'_' separators"),
    ("a:\n  b: 1:30\n", "base 60"), ("a:\n  b: 1_0.5\n", "'_' separators"),
    ("a:\n  b: -0x10\n", "hexadecimal"), ("a:\n  b: !!int 0x10\n", "hexadecimal"),
])
def test_yaml11_numbers_that_are_not_plain_decimal_are_refused(text, kind):
    """PyYAML reads ``0x10`` as 16, ``010`` as 8, ``10_000`` as 10000, ``1:30`` as 90: a value
    nobody meant (``idle_timeout: 1:30`` would be 90 seconds). Refused with line and field."""
    with pytest.raises(yamlfile.YamlProblem) as err:
        yamlfile.parse(text)
    assert (err.value.line, err.value.field) == (2, "a.b")
    assert kind in err.value.message and "plain decimal" in err.value.message


@pytest.mark.parametrize("text, value", [
    ("b: 0\n", 0), ("b: -3\n", -3), ("b: +7\n", 7), ("b: 1.5\n", 1.5), ("b: 1.0e+3\n", 1000.0),
    ("b: .5\n", 0.5), ("b: '0x10'\n", "0x10"), ('b: "010"\n', "010"), ("b: 10m\n", "10m"),
])
def test_plain_decimal_numbers_and_quoted_text_are_kept(text, value):
    assert yamlfile.parse(text)[0] == {"b": value}
