"""partrain serve: preprocessing as the datasets were made, the model file, the server, the page in Chromium."""

from __future__ import annotations

import base64
import http.client
import json
import socket
import shutil
import subprocess
import threading
import urllib.parse
from pathlib import Path

import pytest
import torch

from partrain import model_file
from partrain.cli import main
from partrain.config import RunConfig
from partrain.data import load_dataset
from partrain.runner import run_training
from partrain.serve.preprocess import to_sample
from partrain.serve.server import load_reader, make_server

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def mnist_model(tmp_path_factory, data_dir) -> Path:
    path = tmp_path_factory.mktemp("serve") / "mnist.pt"
    run_training(RunConfig(data_dir=str(data_dir), limit=8000, eval_limit=500, batch_size=32, threads=1,
                           save_model=str(path), model_options={"hidden": [64]}), show_progress=False)
    return path


@pytest.fixture(scope="module")
def server(mnist_model):
    reader = load_reader(str(mnist_model))
    srv = make_server(reader, "127.0.0.1", 0)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield reader, srv.server_address[1]
    srv.shutdown()
    srv.server_close()


# ---- preprocessing -----------------------------------------------------------------------------


def test_an_mnist_image_redrawn_is_itself(data_dir):
    """MNIST's recipe applied to MNIST's own images changes nothing: box 20x20, mass at (14, 14)."""
    test = load_dataset("mnist", "test", data_dir=data_dir, limit=300)
    for img in test.pixels[:, 0]:
        assert torch.equal(to_sample(img, "mnist")[0], img.float())


def test_a_drawing_anywhere_and_any_size_becomes_the_same_sample(data_dir):
    img = load_dataset("mnist", "test", data_dir=data_dir, limit=1).pixels[0, 0]
    big = torch.zeros(300, 400, dtype=torch.uint8)
    big[15:295, 110:390] = img.repeat_interleave(10, 0).repeat_interleave(10, 1)  # 10x, off centre
    sample = to_sample(big, "mnist")[0]
    assert sample.shape == (28, 28)
    rows, cols = torch.nonzero(sample > 0, as_tuple=True)
    assert max(rows.max() - rows.min() + 1, cols.max() - cols.min() + 1) <= 21  # fitted into the 20x20 box
    ys = torch.arange(28.0)
    assert (sample.sum(1) * ys).sum() / sample.sum() == pytest.approx(14, abs=0.5)  # centred by mass
    assert (sample.sum(0) * ys).sum() / sample.sum() == pytest.approx(14, abs=0.5)
    # the same digit at 10x reads as the digit: close to the original, pixel for pixel
    assert (sample - img.float()).abs().mean() < 20
    assert to_sample(torch.zeros(50, 50, dtype=torch.uint8), "mnist").abs().sum() == 0  # nothing drawn, nothing seen


def test_an_ocr_letter_redrawn_is_itself(data_dir):
    test = load_dataset("ocr-letters", "test", data_dir=data_dir)
    same = sum(bool(torch.equal(to_sample(img * 255, "ocr-letters")[0], img.float())) for img in test.pixels[:, 0])
    assert same >= 0.95 * len(test)  # binary, fitted into 16x8, centred; the rest differ by a row of centring


# ---- the model file ----------------------------------------------------------------------------


def test_save_model_writes_what_rebuilds_the_model(mnist_model, data_dir):
    saved = model_file.load(str(mnist_model))
    assert (saved.model, saved.dataset, saved.model_options) == ("mlp", "mnist", {"hidden": [64]})
    net = saved.build()
    x, y = load_dataset("mnist", "test", data_dir=data_dir, limit=500).get(torch.arange(500))
    assert (net(x).argmax(1) == y).float().mean() > 0.85  # the trained weights, not a fresh model


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    (b"this is not a torch file", "cannot read model file"),
    ("state_dict", "is not a partrain model file"),
    ("cifar", "serve reads drawings of mnist, emnist, ocr-letters only"),
])
def test_a_bad_model_file_is_one_line_and_exit_2(tmp_path, mnist_model, capsys, content, message):
    path = tmp_path / "bad.pt"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content == "state_dict":  # a bare state_dict, as --save-model wrote before it kept the model's name
        torch.save(model_file.load(str(mnist_model)).state_dict, path)
    elif content == "cifar":
        model_file.save(str(path), "mlp", "cifar10", {}, {})
    assert main(["serve", "--model-file", str(path), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("partrain: error:") and message in err and len(err.splitlines()) == 1


def test_serve_refuses_to_listen_beyond_this_machine(mnist_model, capsys):
    assert main(["serve", "--model-file", str(mnist_model), "--host", "0.0.0.0"]) == 2
    assert "serves this machine only" in capsys.readouterr().err


# ---- the server --------------------------------------------------------------------------------


def _request(port: int, method: str, path: str, body: bytes | None = None, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request(method, path, body=body, headers=headers or {})
    res = conn.getresponse()
    data = res.read()
    conn.close()
    return res.status, data


def _drawing(img: torch.Tensor, scale: int = 10) -> bytes:
    big = img.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
    return json.dumps({"width": big.shape[1], "height": big.shape[0],
                       "ink": base64.b64encode(bytes(big.flatten().tolist())).decode()}).encode()


def test_predict_reads_a_drawn_digit_as_the_model_reads_the_image(server, data_dir):
    reader, port = server
    test = load_dataset("mnist", "test", data_dir=data_dir, limit=8)
    x, _ = test.get(torch.arange(8))
    with torch.no_grad():
        direct = torch.softmax(reader.model(x), 1)
    status, page = _request(port, "GET", "/")
    assert status == 200 and b"<canvas" in page
    status, info = _request(port, "GET", "/info")
    assert status == 200 and json.loads(info)["classes"] == [str(d) for d in range(10)]
    for i in range(8):
        status, body = _request(port, "POST", "/predict", _drawing(test.pixels[i, 0]))
        out = json.loads(body)
        assert status == 200 and out["prediction"] == int(direct[i].argmax())
        assert out["probabilities"] == pytest.approx(direct[i].tolist(), abs=0.05)
        assert len(out["sample"]) == 28 * 28


@pytest.mark.parametrize("body, headers, status, message", [
    (b"{}", {}, 400, "expected JSON"),
    (json.dumps({"width": 10, "height": 10, "ink": base64.b64encode(b"\0" * 99).decode()}).encode(), {}, 400, "not width x height"),
    (json.dumps({"width": 5000, "height": 1, "ink": ""}).encode(), {}, 400, "outside 1..1024"),
    (b"x", {"Content-Length": str(64 * 2**20)}, 413, "at most"),
    (b'{"width": Infinity, "height": 1, "ink": ""}', {}, 400, "TypeError"),  # dropped the connection, before
    (b"[" * 100_000 + b"]" * 100_000, {}, 400, "RecursionError"),
    (json.dumps({"width": 2.5, "height": 2, "ink": base64.b64encode(b"\0" * 4).decode()}).encode(), {}, 400, "TypeError"),
    (json.dumps({"width": True, "height": 4, "ink": base64.b64encode(b"\0" * 4).decode()}).encode(), {}, 400, "TypeError"),
])
def test_bad_requests_are_refused_with_a_reason(server, body, headers, status, message):
    code, data = _request(server[1], "POST", "/predict", body, headers)
    assert code == status and message in json.loads(data)["error"]
    assert _request(server[1], "GET", "/nonesuch")[0] == 404


def test_other_methods_and_query_strings_get_json_answers(server):
    code, data = _request(server[1], "PUT", "/predict", b"{}")
    assert code == 405 and "PUT is not served" in json.loads(data)["error"]  # http.server's HTML 501, before
    code, data = _request(server[1], "POST", "/predict?from=page", b"{}")
    assert code == 400 and "expected JSON" in json.loads(data)["error"]  # a 404 for /predict?from=page, before


def test_a_client_that_sends_nothing_does_not_hold_the_page_for_others(server):
    """One idle connection held the single-threaded server for everyone, for as long as it
    stayed open; requests are served side by side now, and an idle one is dropped."""
    idle = socket.create_connection(("127.0.0.1", server[1]))
    try:
        assert _request(server[1], "GET", "/info")[0] == 200
    finally:
        idle.close()


@pytest.mark.parametrize("port", ["70000", "-1"])
def test_a_port_out_of_range_is_one_line(mnist_model, capsys, port):
    assert main(["serve", "--model-file", str(mnist_model), "--port", port]) == 2
    assert "a port is 0 to 65535" in capsys.readouterr().err


# ---- the page, in a real browser ---------------------------------------------------------------


def _chromium(tmp_path, url: str, *extra: str) -> str:
    proc = subprocess.run([CHROMIUM, *CHROMIUM_FLAGS, f"--user-data-dir={tmp_path / 'chromium'}",
                           "--virtual-time-budget=20000", *extra, url], capture_output=True, text=True, timeout=120)
    return proc.stdout


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_page_reads_drawn_test_images_as_the_model_does(server, data_dir, tmp_path):
    import re

    reader, port = server
    test = load_dataset("mnist", "test", data_dir=data_dir, limit=12)
    x, _ = test.get(torch.arange(12))
    with torch.no_grad():
        direct = reader.model(x).argmax(1).tolist()
    images = ",".join(urllib.parse.quote(base64.b64encode(bytes(img.flatten().tolist())).decode()) for img in test.pixels[:, 0])
    dom = _chromium(tmp_path, f"http://127.0.0.1:{port}/#draw={images}", "--dump-dom")
    assert 'data-done="1"' in dom, dom[-2000:]
    page = [int(p) for p in re.findall(r'<li data-prediction="(-?\d+)"', dom)]
    assert page == direct  # drawn on the canvas, read back, preprocessed: the same class for every image


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_pen_strokes_read_as_the_digit_they_draw(server, tmp_path):
    """The page's own pen: a vertical stroke is a 1, a Z-shaped one a 2."""
    import re

    port = server[1]
    for strokes, digit in (("0.5,0.15 0.5,0.85", 1), ("0.3,0.3 0.5,0.15 0.7,0.3 0.3,0.8 0.75,0.8", 2)):
        dom = _chromium(tmp_path, f"http://127.0.0.1:{port}/#strokes={urllib.parse.quote(strokes)}", "--dump-dom")
        assert re.findall(r'<li data-prediction="(-?\d+)"', dom) == [str(digit)]
    shot = tmp_path / "page.png"
    _chromium(tmp_path, f"http://127.0.0.1:{port}/#strokes={urllib.parse.quote(strokes)}", "--window-size=1000,560",
              f"--screenshot={shot}")
    assert shot.stat().st_size > 5000
