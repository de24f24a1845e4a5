"""The interactive page: self-contained, and drawn right in a real headless Chromium."""

from __future__ import annotations

import json
import re

import pytest
import torch

from attnkit.inspect.html import render_page, write_html


def _layers(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return [(f"layer {i}", torch.softmax(torch.randn(3, 5, 5, generator=gen) * 2, dim=-1)) for i in range(2)]


TOKENS = ["<b>The</b>", "cat", "sat", "</script>", "down"]


def _data(page: str) -> dict:
    payload = re.search(r'<script id="attnkit-data" type="application/json">(.*?)</script>', page, re.S)
    assert payload is not None
    return json.loads(payload.group(1))


def test_page_is_self_contained_and_carries_the_data():
    page = render_page(TOKENS, _layers(), title="A <title> & more")
    assert "<title>A &lt;title&gt; &amp; more</title>" in page
    assert not re.search(r"<script[^>]+src=|<link|@import|url\(|https?://(?!www\.w3\.org/2000/svg)", page)
    data = _data(page)
    assert data["tokens"] == TOKENS  # "</script>" in a token did not end the data block
    torch.testing.assert_close(torch.tensor(data["layers"][1]["weights"]), _layers()[1][1], atol=5e-5, rtol=0)


def test_page_refuses_mismatched_or_huge_input():
    with pytest.raises(ValueError, match=r"layer 'x': weights must be \(H, T=2, S=2\), got \(1, 3, 3\)"):
        render_page(["a", "b"], [("x", torch.rand(1, 3, 3))])
    with pytest.raises(ValueError, match=r"too many for one page"):
        render_page(["a"] * 600, [("x", torch.rand(12, 600, 600))])
    with pytest.raises(ValueError, match=r"at least one token and one layer"):
        render_page([], [])


@pytest.mark.browser
def test_hovering_a_token_draws_its_weights(browser, tmp_path):
    layers = _layers()
    path = write_html(tmp_path / "page.html", TOKENS, layers, title="test page")
    page = browser.new_page(viewport={"width": 1000, "height": 700})
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(path.as_uri())
    page.select_option("#layer", "1")
    page.uncheck('#heads input[data-head="1"]')  # heads 0 and 2 stay
    page.hover('#tokens text[data-side="query"][data-index="2"]')
    lines = page.eval_on_selector_all("#line-layer line", "ls => ls.map(l => ({...l.dataset, "
                                      "opacity: l.getAttribute('stroke-opacity'), stroke: l.getAttribute('stroke')}))")
    assert len(lines) == 2 * 5  # every key, for each of the two heads left
    weights = layers[1][1]
    for line in lines:
        head, query, key = int(line["head"]), int(line["query"]), int(line["key"])
        assert head in (0, 2) and query == 2
        assert abs(float(line["weight"]) - weights[head, query, key].item()) < 1e-4
        assert abs(float(line["opacity"]) - weights[head, query, key].item()) < 1e-4
    assert len({line["stroke"] for line in lines}) == 2  # one colour per head
    assert "Query \"sat\"" in page.inner_text("#status")
    page.screenshot(path=str(tmp_path / "head-view.png"))
    page.hover("h1")  # leave the token: lines of weight >= 0.05 for every query
    shown = page.eval_on_selector_all("#line-layer line", "ls => ls.map(l => Number(l.dataset.weight))")
    assert len(shown) == int(((weights[[0, 2]] >= 0.05).sum()).item()) and min(shown) >= 0.05
    page.click("#show-heatmap")
    page.select_option("#heatmap-head", "2")
    cells = page.eval_on_selector_all("#heatmap td", "cs => cs.map(c => [Number(c.dataset.query), "
                                      "Number(c.dataset.key), Number(c.dataset.value)])")
    assert len(cells) == 25
    for q, k, value in cells:
        assert abs(value - weights[2, q, k].item()) < 1e-4
    # the heatmap has a colour scale and says which axis is which; the head view's controls are hidden
    assert page.is_visible("#scale") and "queries" in page.text_content("#scale")
    assert "linear-gradient" in page.eval_on_selector("#scale-bar", "b => b.style.background")
    assert not page.is_visible("#heads") and not page.is_visible("#status")
    page.click("#show-head-view")
    assert page.is_visible("#heads") and not page.is_visible("#scale")
    page.click("#show-heatmap")
    page.screenshot(path=str(tmp_path / "heatmap.png"))
    assert (tmp_path / "head-view.png").read_bytes()[:4] == b"\x89PNG"
    assert errors == [] and all(url.startswith("file://") for url in requests)
    page.close()


def test_title_holding_the_data_placeholder_keeps_the_json_out_of_the_title():
    """A text containing `__DATA__` put the page's JSON into its <title>."""
    tokens = ["__DATA__", "__TITLE__", "c", "d", "e"]
    page = render_page(tokens, _layers()[:1], title="see __DATA__ and __TITLE__")
    assert "<title>see __DATA__ and __TITLE__</title>" in page
    assert page.count('"layers":') == 1
    assert _data(page)["tokens"] == tokens


def test_head_view_shows_itself_in_a_notebook_as_the_page_in_an_iframe():
    import html as html_lib

    from attnkit.inspect.html import HeadView, render_page

    weights = torch.softmax(torch.randn(2, 3, 3), dim=-1)
    shown = HeadView(["a", "<b>", "c"], [("layer", weights)], title="T & <i>")
    markup = shown._repr_html_()
    assert markup.startswith('<iframe srcdoc="') and 'sandbox="allow-scripts"' in markup
    inner = markup.split('srcdoc="', 1)[1].split('" sandbox=', 1)[0]
    assert html_lib.unescape(inner) == render_page(["a", "<b>", "c"], [("layer", weights)], title="T & <i>")
    assert "<b>" not in inner  # escaped for the attribute: the notebook never parses the page's tags


@pytest.mark.browser
def test_the_page_opens_on_the_layer_and_head_asked_for(browser, tmp_path):
    """Bug: `explain --html --layer 2 --head 8` wrote a page whose heading said layer 2, head 8 but that opened
    on layer 0 with every head chosen."""
    layers = _layers() + _layers(seed=1)  # layers 0 to 3, 3 heads each
    path = write_html(tmp_path / "page.html", TOKENS, layers, title="test page", layer=2, head=1)
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(path.as_uri())
    assert page.input_value("#layer") == "2"
    assert page.eval_on_selector_all("#heads input", "cs => cs.map(c => c.checked)") == [False, True, False]
    shown = page.eval_on_selector_all("#line-layer line", "ls => ls.map(l => [Number(l.dataset.head), "
                                      "Number(l.dataset.query), Number(l.dataset.key)])")
    assert {head for head, _, _ in shown} == {1}
    assert len(shown) == int((layers[2][1][1] >= 0.05).sum())  # layer 2's head 1, not layer 0's
    page.click("#show-heatmap")
    assert page.input_value("#heatmap-head") == "1"
    cells = page.eval_on_selector_all("#heatmap td", "cs => cs.map(c => Number(c.dataset.value))")
    torch.testing.assert_close(torch.tensor(cells).view(5, 5), layers[2][1][1], atol=5e-5, rtol=0)
    assert errors == []
    page.close()


def test_a_page_refuses_to_open_on_a_layer_or_head_it_lacks():
    with pytest.raises(ValueError, match=r"layer 2 is out of range: the page has layers 0 to 1"):
        render_page(TOKENS, _layers(), layer=2)
    with pytest.raises(ValueError, match=r"head 3 is out of range: layer 1 has heads 0 to 2"):
        render_page(TOKENS, _layers(), layer=1, head=3)
