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


def test_aliases_when_allowed_but_never_merge_keys():
    data, _ = yamlfile.parse("a: &x [1]\nb: *x\n", aliases=True)
    assert data == {"a": [1], "b": [1]}
    with pytest.raises(yamlfile.YamlProblem, match="merge key"):
        yamlfile.parse("a: &x {c: 1}\nb: {<<: *x}\n", aliases=True)
