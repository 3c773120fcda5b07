"""The HTML building blocks of the report: page shell, tables, images, sections.

Everything inline: CSS, one small script (sort by a header click, filter, page through
long tables), images as base64 PNG data URIs. No network, no template engine; values
are escaped with ``html.escape``.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Iterable
from pathlib import Path

from partrain.atomic import write_atomic

PAGE_ROWS = 50  # rows per page of a long table: 500 cells stay 10 short pages

STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:0;color:#222;background:#fafafa}
main{max-width:1250px;margin:0 auto;padding:16px 24px 48px}
h1{font-size:22px;margin:8px 0 2px} .meta{color:#666;margin-bottom:14px}
details{background:#fff;border:1px solid #ddd;border-radius:6px;margin:12px 0;padding:4px 14px 10px}
summary{font-size:17px;font-weight:600;cursor:pointer;padding:6px 0}
table{border-collapse:collapse;margin:6px 0 10px;font-size:13px;background:#fff}
th,td{border-bottom:1px solid #e3e3e3;padding:3px 8px;text-align:right;white-space:nowrap}
th{background:#f0f0f0;position:sticky;top:0} th.s{cursor:pointer} th.s:after{content:" \\2195";color:#aaa}
td.t,th.t{text-align:left} tr.bad td{color:#a33} tr:hover td{background:#f5f9ff}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:10px 0}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:8px 12px;min-width:210px}
.card b{font-size:20px;display:block} .card small{color:#666}
img{max-width:100%;height:auto;border:1px solid #eee;background:#fff;margin:6px 0}
code{background:#f2f2f2;padding:1px 4px;border-radius:3px;font-size:12px;white-space:pre-wrap}
.note{color:#666;font-size:13px} .pager{margin:4px 0} .pager button{margin:0 2px}
input.filter{padding:3px 6px;width:260px;margin:4px 0}
.wide{overflow-x:auto} td.cmd{white-space:normal;min-width:420px;font-size:12px}
"""

# Sortable, filterable, paged tables. Sorting reads a cell's data-v (numbers) or its text.
SCRIPT = r"""
document.querySelectorAll('table.sortable').forEach(function (table) {
  var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
  var per = Number(table.dataset.page || 0), page = 0, shown = rows, dir = {};
  var pager = table.parentNode.querySelector('.pager'), filter = table.parentNode.querySelector('input.filter');
  function render() {
    var pages = per ? Math.max(1, Math.ceil(shown.length / per)) : 1;
    page = Math.min(page, pages - 1);
    var part = per ? shown.slice(page * per, page * per + per) : shown;
    body.replaceChildren.apply(body, part);
    if (pager) {
      pager.replaceChildren();
      var info = document.createElement('span');
      info.textContent = shown.length + ' of ' + rows.length + ' rows' + (pages > 1 ? ', page ' + (page + 1) + ' of ' + pages + ' ' : ' ');
      pager.appendChild(info);
      if (pages > 1) [['first', 0], ['previous', page - 1], ['next', page + 1], ['last', pages - 1]].forEach(function (b) {
        var btn = document.createElement('button'); btn.textContent = b[0];
        btn.disabled = b[1] < 0 || b[1] >= pages || b[1] === page;
        btn.onclick = function () { page = b[1]; render(); }; pager.appendChild(btn);
      });
    }
  }
  function key(row, i) { var c = row.cells[i]; var v = c.dataset.v; return v === undefined ? c.textContent.toLowerCase() : Number(v); }
  Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th, i) {
    th.classList.add('s');
    th.onclick = function () {
      dir[i] = -(dir[i] || -1);
      shown = shown.slice().sort(function (a, b) {
        var x = key(a, i), y = key(b, i);
        if (typeof x === 'number' && isNaN(x)) return 1; if (typeof y === 'number' && isNaN(y)) return -1;
        return (x < y ? -1 : x > y ? 1 : 0) * dir[i];
      });
      page = 0; render();
    };
  });
  if (filter) filter.oninput = function () {
    var words = filter.value.toLowerCase().split(/\s+/).filter(Boolean);
    shown = rows.filter(function (r) { var t = r.textContent.toLowerCase(); return words.every(function (w) { return t.indexOf(w) >= 0; }); });
    page = 0; render();
  };
  render();
});
"""


def esc(value) -> str:
    return html.escape(str(value))


def fmt(value, spec: str = ".2f", scale: float = 1.0, suffix: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ""
    return format(value * scale, spec) + suffix


def cell(value, text: str | None = None, left: bool = False, title: str | None = None) -> str:
    """A <td>: numbers carry their value in data-v for sorting; text cells align left."""
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    attrs = f' data-v="{value!r}"' if numeric else (' data-v="NaN"' if value is None else "")
    if left or not (numeric or value is None):
        attrs += ' class="t"'
    if title:
        attrs += f' title="{esc(title)}"'
    return f"<td{attrs}>{esc(text if text is not None else ('' if value is None else value))}</td>"


def table(headers: list[str], rows: Iterable[tuple[str, str]], css_id: str = "", paged: bool = False,
          left: int | set[int] = 1) -> str:
    """A sortable table. ``rows``: (row class, joined <td> cells). Headers align left where their
    column holds text: the first ``left`` ones, or those whose index is in ``left``.
    ``paged``: a filter box and pages of ``PAGE_ROWS``."""
    lefts = set(range(left)) if isinstance(left, int) else left
    head = "".join(f'<th{" class=t" if i in lefts else ""}>{esc(h)}</th>' for i, h in enumerate(headers))
    body = "".join(f'<tr class="{cls}">{cells}</tr>' for cls, cells in rows)
    extra = f' data-page="{PAGE_ROWS}"' if paged else ""
    controls = '<input class="filter" placeholder="filter rows, e.g. cnn ddp x2" aria-label="filter rows">' if paged else ""
    return (f'<div class="wide">{controls}<table class="sortable"{extra}{f" id={css_id}" if css_id else ""}>'
            f"<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table><div class=pager></div></div>")


def figure_png(fig, dpi: int = 90, **savefig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, **savefig)
    return buf.getvalue()


def write_png(fig, path, dpi: int = 90, **savefig) -> Path:
    """``fig`` as a PNG at exactly ``path`` (savefig would add ``.png`` to a name without it),
    written whole (``atomic.write_atomic``)."""
    return write_atomic(path, figure_png(fig, dpi, **savefig))


def img(png: bytes, alt: str, css: str = "") -> str:
    data = base64.b64encode(png).decode()
    return f'<img class="{css}" alt="{esc(alt)}" src="data:image/png;base64,{data}">'


def section(title: str, body: str, css_id: str, open_: bool = True) -> str:
    return f'<details id="sec-{css_id}"{" open" if open_ else ""}><summary>{esc(title)}</summary>{body}</details>'


def page(title: str, meta: str, body: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width,initial-scale=1"><title>{esc(title)}</title>'
            f"<style>{STYLE}</style></head><body><main><h1>{esc(title)}</h1><div class=meta>{meta}</div>"
            f"{body}</main><script>{SCRIPT}</script></body></html>\n")
