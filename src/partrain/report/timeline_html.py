"""A self-contained HTML page that draws a Chrome trace: the offline timeline viewer.

Perfetto and chrome://tracing need a network or a browser's internals; this page needs
neither. The trace JSON sits inside the page; about 150 lines of script draw one row per
(process, thread) as SVG, zoom with the wheel or the buttons, pan by dragging, and show a
span's arguments on hover. Rendering costs one pass over the spans in view per redraw.
"""

from __future__ import annotations

import html
import json

from partrain.report.gantt import COLOURS, OTHER

STYLE = """
body{font:13px system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:18px;margin:0 0 4px} .sub{color:#555;margin-bottom:8px}
#bar button{margin-right:4px} #legend span{display:inline-block;margin-right:10px}
#legend i{display:inline-block;width:11px;height:11px;margin-right:3px;vertical-align:-1px}
#tl{border:1px solid #ccc;overflow:hidden;cursor:grab;user-select:none;margin-top:6px}
#tip{position:fixed;pointer-events:none;background:#fff;border:1px solid #888;padding:4px 6px;font-size:12px;
 display:none;white-space:pre;box-shadow:1px 1px 4px #0003}
text{font-size:11px} .proc{font-weight:600}
"""

SCRIPT = r"""
(function(){
const trace = JSON.parse(document.getElementById('trace-data').textContent);
const colours = JSON.parse(document.getElementById('colours').textContent);
const procs = {}, threads = {}, spans = [];
for (const e of trace.traceEvents) {
  if (e.ph === 'M' && e.name === 'process_name') procs[e.pid] = e.args.name;
  else if (e.ph === 'M' && e.name === 'thread_name') threads[e.pid + ':' + e.tid] = e.args.name;
  else if (e.ph === 'X') spans.push(e);
}
const keys = Object.keys(threads).filter(k => !threads[k].startsWith('step') || k.startsWith('0:'))
  .sort((a, b) => { const [p1, t1] = a.split(':').map(Number), [p2, t2] = b.split(':').map(Number); return p1 - p2 || t1 - t2; });
const row = {}; keys.forEach((k, i) => row[k] = i);
const steps = spans.filter(e => e.pid === 0 && threads['0:' + e.tid] === 'step').sort((a, b) => a.ts - b.ts);
let lo = Math.min(...spans.map(e => e.ts)), hi = Math.max(...spans.map(e => e.ts + e.dur));
const full = [lo, hi];
const RH = 18, LABEL = 230, TOP = 22;
const host = document.getElementById('tl'), tip = document.getElementById('tip');
const ns = 'http://www.w3.org/2000/svg';
function el(name, attrs, parent) { const n = document.createElementNS(ns, name); for (const k in attrs) n.setAttribute(k, attrs[k]); if (parent) parent.appendChild(n); return n; }
function draw() {
  const width = Math.max(400, host.clientWidth - 2), plot = width - LABEL - 10;
  const height = TOP + keys.length * RH + 8;
  const svg = el('svg', {width: width, height: height, id: 'timeline-svg'});
  const x = t => LABEL + (t - lo) / (hi - lo) * plot;
  let lastPid = null;
  keys.forEach((k, i) => {
    const pid = Number(k.split(':')[0]), y = TOP + i * RH;
    if (pid !== lastPid) { el('line', {x1: 0, x2: width, y1: y, y2: y, stroke: '#999'}, svg); lastPid = pid; }
    if (i % 2) el('rect', {x: LABEL, y: y, width: plot, height: RH, fill: '#f7f7f7'}, svg);
    const t = el('text', {x: 4, y: y + 13}, svg);
    t.textContent = (procs[pid] || pid).split(' (')[0] + ' · ' + threads[k];
  });
  const ticks = 8;
  for (let j = 0; j <= ticks; j++) {
    const t = lo + (hi - lo) * j / ticks, px = x(t);
    el('line', {x1: px, x2: px, y1: TOP - 4, y2: height, stroke: '#ddd'}, svg);
    const lab = el('text', {x: j === ticks ? px - 2 : px + 2, y: 12, fill: '#666', 'text-anchor': j === ticks ? 'end' : 'start'}, svg);
    lab.textContent = ((t - full[0]) / 1000).toFixed(2) + ' ms';
  }
  let drawn = 0;
  spans.forEach((e, i) => {
    const k = e.pid + ':' + e.tid;
    if (!(k in row) || e.ts + e.dur < lo || e.ts > hi) return;
    const x0 = Math.max(LABEL, x(e.ts)), x1 = Math.min(LABEL + plot, x(e.ts + e.dur));
    const r = el('rect', {x: x0, y: TOP + row[k] * RH + 2, width: Math.max(1, x1 - x0), height: RH - 4,
      fill: colours[e.cat] || colours._other, 'class': 'span'}, svg);
    r.dataset.i = i;
    if (x1 - x0 > 18 && /^[FB]\d+$/.test(e.name)) {
      const t = el('text', {x: (x0 + x1) / 2, y: TOP + row[k] * RH + 13, fill: '#fff', 'text-anchor': 'middle'}, svg);
      t.textContent = e.name;
    }
    drawn++;
  });
  host.replaceChildren(svg);
  document.body.dataset.spansDrawn = drawn;
  document.getElementById('range').textContent = ((hi - lo) / 1000).toFixed(2) + ' ms in view, ' + drawn + ' spans';
}
function zoom(f, at) { at = at === undefined ? (lo + hi) / 2 : at; lo = at - (at - lo) * f; hi = at + (hi - at) * f; draw(); }
document.getElementById('all').onclick = () => { [lo, hi] = full; draw(); };
document.getElementById('last').onclick = () => { if (steps.length) { const a = steps[Math.max(0, steps.length - 2)], b = steps[steps.length - 1]; lo = a.ts; hi = b.ts + b.dur * 1.05; draw(); } };
document.getElementById('in').onclick = () => zoom(0.5);
document.getElementById('out').onclick = () => zoom(2);
host.addEventListener('wheel', ev => { ev.preventDefault(); const r = host.getBoundingClientRect(), px = ev.clientX - r.left - LABEL;
  zoom(ev.deltaY < 0 ? 0.8 : 1.25, lo + (hi - lo) * Math.min(1, Math.max(0, px / (r.width - LABEL - 10)))); }, {passive: false});
let drag = null;
host.addEventListener('mousedown', ev => { drag = [ev.clientX, lo, hi]; host.style.cursor = 'grabbing'; });
window.addEventListener('mouseup', () => { drag = null; host.style.cursor = 'grab'; });
window.addEventListener('mousemove', ev => {
  if (drag) { const dt = (ev.clientX - drag[0]) / (host.clientWidth - LABEL - 10) * (drag[2] - drag[1]); lo = drag[1] - dt; hi = drag[2] - dt; draw(); return; }
  const i = ev.target.dataset && ev.target.dataset.i;
  if (i === undefined) { tip.style.display = 'none'; return; }
  const e = spans[i], args = Object.entries(e.args || {}).map(([k, v]) => k + ': ' + v).join('\n');
  tip.textContent = (procs[e.pid] || e.pid) + ' · ' + threads[e.pid + ':' + e.tid] + '\n' + e.name + ' (' + e.cat + '), ' +
    (e.dur / 1000).toFixed(3) + ' ms' + (args ? '\n' + args : '');
  tip.style.left = (ev.clientX + 12) + 'px'; tip.style.top = (ev.clientY + 12) + 'px'; tip.style.display = 'block';
});
window.addEventListener('resize', draw);
document.getElementById('legend').innerHTML = [...new Set(spans.map(e => e.cat))]
  .map(c => '<span><i style="background:' + (colours[c] || colours._other) + '"></i>' + c + '</span>').join('');
if (steps.length > 3) document.getElementById('last').click(); else draw();
})();
"""


def script_json(data) -> str:
    """JSON safe inside a <script> element (no "</script>" can end it early)."""
    return json.dumps(data, separators=(",", ":")).replace("</", "<\\/")


def timeline_page(trace: dict, title: str) -> str:
    """The whole page: the trace inside, the viewer script, nothing fetched."""
    other = trace.get("otherData", {})
    sub = []
    if other.get("measured_step_ms") is not None:
        sub.append(f"measured {other['measured_step_ms']:.2f} ms/step (median after the first step, rank 0)")
    if other.get("predicted_step_ms") is not None:
        sub.append(f"predicted {other['predicted_step_ms']:.2f} ms/step ({other.get('plan', '')})")
    sub += other.get("notes") or []
    colours = {**COLOURS, "_other": OTHER}
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style></head>
<body>
<h1>{html.escape(title)}</h1>
<div class="sub">{html.escape('; '.join(sub))}</div>
<div id="bar"><button id="all">whole run</button><button id="last">last 2 steps</button>
<button id="in">zoom in</button><button id="out">zoom out</button> <span id="range"></span>
&nbsp; wheel: zoom, drag: pan, hover: details</div>
<div id="legend"></div>
<div id="tl"></div><div id="tip"></div>
<script type="application/json" id="trace-data">{script_json(trace)}</script>
<script type="application/json" id="colours">{script_json(colours)}</script>
<script>{SCRIPT}</script>
</body></html>
"""
