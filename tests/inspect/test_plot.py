"""Heatmaps: one panel per head with tokens and a colour bar; a layers x heads grid."""

from __future__ import annotations

import sys

import pytest
import torch

from tests._util import need


@pytest.fixture(autouse=True)
def _matplotlib():
    need("matplotlib")


def test_plot_heads_panels_ticks_colorbar_and_data(tmp_path):
    from attnkit.inspect.plot import plot_heads

    weights = torch.softmax(torch.randn(3, 4, 5), dim=-1)
    fig = plot_heads(weights, ["a", "b", "c", "d"], ["k0", "k1", "k2", "k3", "k4"], title="three heads", columns=2)
    panels = [ax for ax in fig.axes if ax.get_images()]
    colorbars = [ax for ax in fig.axes if ax.get_label() == "<colorbar>"]
    assert len(panels) == 3 and len(colorbars) == 1
    assert [ax.get_title() for ax in panels] == ["head 0", "head 1", "head 2"]
    assert [t.get_text() for t in panels[1].get_yticklabels()] == ["a", "b", "c", "d"]
    assert [t.get_text() for t in panels[1].get_xticklabels()] == ["k0", "k1", "k2", "k3", "k4"]
    torch.testing.assert_close(torch.as_tensor(panels[2].get_images()[0].get_array().data), weights[2])
    fig.savefig(tmp_path / "heads.png")
    assert (tmp_path / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_model_view_grid(tmp_path):
    from attnkit.inspect.plot import plot_model_view

    weights = torch.softmax(torch.randn(2, 3, 4, 4), dim=-1)
    fig = plot_model_view(weights, list("abcd"), layer_names=["first", "second"])
    panels = [ax for ax in fig.axes if ax.get_images()]
    assert len(panels) == 6
    assert panels[3].get_ylabel() == "second" and panels[2].get_title() == "head 2"
    torch.testing.assert_close(torch.as_tensor(panels[4].get_images()[0].get_array().data), weights[1, 1])
    fig.savefig(tmp_path / "model.png")


def test_bad_input():
    from attnkit.inspect.plot import plot_heads, plot_model_view

    with pytest.raises(ValueError, match=r"weights \(H, T, S\) must be a 3-d tensor, got \(4, 4\)"):
        plot_heads(torch.rand(4, 4), list("abcd"))
    with pytest.raises(ValueError, match=r"3 query tokens for a weights axis of size 4"):
        plot_heads(torch.rand(1, 4, 4), list("abc"))
    with pytest.raises(ValueError, match=r"1 layer names for 2 layers"):
        plot_model_view(torch.rand(2, 1, 3, 3), list("abc"), layer_names=["x"])


def test_missing_matplotlib_names_the_extra(monkeypatch):
    from attnkit.inspect.plot import plot_heads

    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"needs the optional package 'matplotlib', which is not installed: "
                                          r"pip install -c constraints.txt 'attnkit\[viz\]'"):
        plot_heads(torch.rand(1, 2, 2), ["a", "b"])


def test_dollar_signs_in_tokens_and_titles_are_not_math_text(tmp_path):
    """A token or title with `$` was parsed as matplotlib math text: `$\\frac$` failed at savefig."""
    from attnkit.inspect.plot import plot_heads, plot_model_view

    tokens = ["$x$", "$\\frac$", "costs $5"]
    fig = plot_heads(torch.rand(1, 3, 3), tokens, title="price in $ and $\\alpha")
    fig.savefig(tmp_path / "heads.png")
    panel = next(ax for ax in fig.axes if ax.get_images())
    labels = [t.get_text() for t in panel.get_yticklabels()]
    assert [label.replace("\\$", "$") for label in labels] == tokens
    plot_model_view(torch.rand(1, 1, 3, 3), tokens, layer_names=["$\\frac$"]).savefig(tmp_path / "model.png")


def test_heatmaps_name_their_axes_and_wrap_a_long_title():
    """Heatmaps had no axis names; `explain --png`'s long title was cut off at the figure's edge."""
    import torch

    from attnkit.inspect.plot import plot_heads, plot_model_view

    title = "attnkit explain: textbook MultiHeadAttention(d_in=3, d_out=4, num_heads=2) " * 2
    fig = plot_heads(torch.softmax(torch.randn(3, 4, 4), -1), list("abcd"), title=title, columns=2)
    shown = [ax for ax in fig.axes if ax.get_images()]
    assert {ax.get_ylabel() for ax in shown if ax.get_ylabel()} == {"queries"}
    assert {ax.get_xlabel() for ax in shown if ax.get_xlabel()} == {"keys"}
    assert fig._suptitle.get_wrap()
    view = plot_model_view(torch.softmax(torch.randn(2, 2, 3, 3), -1), list("abc"), title=title)
    assert "queries down, keys across" in view._supxlabel.get_text() and view._suptitle.get_wrap()
