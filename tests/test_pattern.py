import pytest

from nmdeploy import PatternError
from nmdeploy.masks import Pattern


@pytest.mark.parametrize(
    "text,n,m",
    [("2:4", 2, 4), ("1:2", 1, 2), ("4:8", 4, 8), ("8:16", 8, 16), ("16:32", 16, 32), (" 3 : 4 ", 3, 4), ("7:8", 7, 8)],
)
def test_parse_valid(text, n, m):
    pattern = Pattern.parse(text)
    assert (pattern.n, pattern.m) == (n, m)
    assert str(pattern) == f"{n}:{m}"
    assert pattern.density == pytest.approx(n / m)


@pytest.mark.parametrize(
    "text,message",
    [
        ("2/4", "expected 'N:M'"),
        ("two:four", "expected 'N:M'"),
        ("", "expected 'N:M'"),
        ("2:4:8", "expected 'N:M'"),
        ("-1:4", "expected 'N:M'"),
        ("5:4", "N must be below M"),
        # N = M keeps every element: any dense weight would pass every check under it.
        ("4:4", r"pattern 4:4: N must be below M \(N:M keeps N of every M elements\); use one such as 2:4"),
        ("2:2", "N must be below M"),
        ("0:4", "N must be at least 1"),
        ("1:1", "M must be at least 2"),
        ("0:0", "M must be at least 2"),
    ],
)
def test_parse_invalid(text, message):
    with pytest.raises(PatternError, match=message):
        Pattern.parse(text)


def test_parse_rejects_non_strings_and_constructor_validates():
    with pytest.raises(PatternError):
        Pattern.parse(24)
    with pytest.raises(PatternError):
        Pattern(3, 2)
    with pytest.raises(PatternError, match="N must be below M"):
        Pattern(8, 8)
    with pytest.raises(PatternError):
        Pattern(True, 4)
    assert Pattern.parse(Pattern(2, 4)) == Pattern(2, 4)
