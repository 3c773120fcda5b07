"""The drawing page: one self-contained HTML file, no external scripts, fonts or images.

A person draws with the mouse, a finger or a pen; when a stroke ends, the canvas's ink
(255 - red channel: black on white) goes to ``POST /predict`` and the page shows the class
read, the probability of every class and the sample the model saw (the drawing made into a
dataset sample). Test hook: ``#draw=B64[,B64...]`` draws each base64 sample (rows x cols
bytes, 0-255 ink) onto the canvas pixel by pixel, as squares of ink, predicts it like a
drawing, and lists the results in ``#results``; ``body[data-done]`` is set when all are in.
``#strokes=x,y x,y;x,y x,y`` draws pen strokes (points as fractions of the canvas, strokes
separated by ``;``) with the same pen as a person's, then predicts.
"""

PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>partrain: draw a character</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
 body { font: 15px system-ui, sans-serif; margin: 24px; color: #222; }
 h1 { font-size: 20px; margin: 0 0 4px; } .sub { color: #666; margin-bottom: 16px; }
 .row { display: flex; gap: 28px; align-items: flex-start; flex-wrap: wrap; }
 #pad { border: 2px solid #333; border-radius: 6px; touch-action: none; cursor: crosshair; background: #fff; }
 button { font-size: 15px; padding: 6px 18px; margin-top: 8px; }
 #answer { font-size: 64px; font-weight: 700; line-height: 1; min-height: 64px; }
 #conf { color: #555; margin-bottom: 12px; }
 table { border-collapse: collapse; } td { padding: 1px 6px; font-variant-numeric: tabular-nums; }
 .bar { background: #3b7dd8; height: 12px; } .top .bar { background: #d8553b; } .top td { font-weight: 700; }
 #seen { image-rendering: pixelated; border: 1px solid #999; background: #000; }
</style></head>
<body>
<h1>Draw a character</h1>
<div class="sub" id="what">loading the model...</div>
<div class="row">
 <div><canvas id="pad"></canvas><br><button id="clear">Clear</button></div>
 <div><div id="answer">&nbsp;</div><div id="conf">draw, then lift the pen</div>
  <table id="probs"></table></div>
 <div>what the model sees:<br><canvas id="seen"></canvas></div>
</div>
<ol id="results" hidden></ol>
<script>
"use strict";
const pad = document.getElementById("pad"), ctx = pad.getContext("2d", {willReadFrequently: true});
const seen = document.getElementById("seen");
let info = null, drawing = false, last = null;

function clearPad() {
  ctx.fillStyle = "#fff"; ctx.fillRect(0, 0, pad.width, pad.height);
  document.getElementById("answer").innerHTML = "&nbsp;";
  document.getElementById("conf").textContent = "draw, then lift the pen";
  document.getElementById("probs").innerHTML = "";
}
function at(e) { const r = pad.getBoundingClientRect(); return [(e.clientX - r.left) * pad.width / r.width, (e.clientY - r.top) * pad.height / r.height]; }
function line(a, b) {
  ctx.strokeStyle = "#000"; ctx.lineWidth = info.pen; ctx.lineCap = "round"; ctx.lineJoin = "round";
  ctx.beginPath(); ctx.moveTo(a[0], a[1]); ctx.lineTo(b[0], b[1]); ctx.stroke();
}
pad.addEventListener("pointerdown", e => { drawing = true; last = at(e); line(last, last); pad.setPointerCapture(e.pointerId); });
pad.addEventListener("pointermove", e => { if (drawing) { const p = at(e); line(last, p); last = p; } });
pad.addEventListener("pointerup", () => { if (drawing) { drawing = false; predict(); } });
document.getElementById("clear").addEventListener("click", clearPad);

function ink() {  // the canvas as ink 0-255, base64
  const px = ctx.getImageData(0, 0, pad.width, pad.height).data, out = new Uint8Array(pad.width * pad.height);
  for (let i = 0; i < out.length; i++) out[i] = 255 - px[4 * i];
  let s = ""; for (let i = 0; i < out.length; i += 8192) s += String.fromCharCode.apply(null, out.subarray(i, i + 8192));
  return btoa(s);
}
async function predict() {
  const res = await fetch("predict", {method: "POST", headers: {"Content-Type": "application/json"},
    body: JSON.stringify({width: pad.width, height: pad.height, ink: ink()})});
  const out = await res.json();
  if (!res.ok) { document.getElementById("conf").textContent = out.error; return null; }
  show(out); return out;
}
function show(out) {
  const best = out.prediction, p = out.probabilities;
  document.getElementById("answer").textContent = info.classes[best];
  document.getElementById("conf").textContent = (100 * p[best]).toFixed(1) + "% sure";
  const order = p.map((v, i) => i).sort((a, b) => p[b] - p[a]);
  document.getElementById("probs").innerHTML = order.map(i =>
    `<tr class="${i === best ? "top" : ""}"><td>${info.classes[i]}</td><td>${(100 * p[i]).toFixed(1)}%</td>` +
    `<td><div class="bar" style="width:${Math.max(1, Math.round(160 * p[i]))}px"></div></td></tr>`).join("");
  const [h, w] = info.sample, sc = seen.getContext("2d"), img = sc.createImageData(w, h);
  out.sample.forEach((v, i) => { img.data.set([v, v, v, 255], 4 * i); });
  sc.putImageData(img, 0, 0);
}
function drawPixels(b64) {  // test hook: a dataset sample drawn as squares of ink
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0)), [h, w] = info.sample;
  const cw = pad.width / w, ch = pad.height / h;
  clearPad();
  for (let y = 0; y < h; y++) for (let x = 0; x < w; x++) {
    const v = bytes[y * w + x];
    if (v) { ctx.fillStyle = `rgba(0,0,0,${v / 255})`; ctx.fillRect(x * cw, y * ch, cw, ch); }
  }
}
async function main() {
  info = await (await fetch("info")).json();
  pad.width = info.canvas[1]; pad.height = info.canvas[0];
  seen.width = info.sample[1]; seen.height = info.sample[0];
  seen.style.width = (info.sample[1] * 5) + "px"; seen.style.height = (info.sample[0] * 5) + "px";
  document.getElementById("what").textContent = `${info.model} trained on ${info.dataset}: it reads ${info.classes.join(" ")}`;
  clearPad();
  if (location.hash.startsWith("#draw=")) {
    const list = document.getElementById("results");
    for (const b64 of location.hash.slice(6).split(",")) {
      drawPixels(decodeURIComponent(b64));
      const out = await predict();
      const li = document.createElement("li");
      li.dataset.prediction = out ? out.prediction : -1;
      li.dataset.probabilities = out ? out.probabilities.join(" ") : "";
      list.appendChild(li);
    }
    document.body.dataset.done = "1";
  } else if (location.hash.startsWith("#strokes=")) {
    for (const stroke of decodeURIComponent(location.hash.slice(9)).split(";")) {
      const pts = stroke.trim().split(/\s+/).map(p => p.split(",").map(Number)).map(([x, y]) => [x * pad.width, y * pad.height]);
      pts.forEach((p, i) => line(pts[Math.max(0, i - 1)], p));
    }
    const out = await predict(), li = document.createElement("li");
    li.dataset.prediction = out ? out.prediction : -1;
    document.getElementById("results").appendChild(li);
    document.body.dataset.done = "1";
  }
}
main();
</script></body></html>
"""
