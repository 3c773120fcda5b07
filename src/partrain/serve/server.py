"""``partrain serve --model-file model.pt``: the drawing page on 127.0.0.1, stdlib http.server.

Three routes: ``GET /`` the page, ``GET /info`` what the model reads, ``POST /predict`` a
drawing in, class probabilities out. Requests are bounded (body size, canvas size) and
answered one at a time: a page for one person at this machine, never a public server, so it
binds only to the loopback interface.
"""

from __future__ import annotations

import base64
import binascii
import json
import socket
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer

import torch

from partrain.errors import PartrainError
from partrain.serve.page import PAGE
from partrain.serve.preprocess import CLASSES, SHAPES, normalize, to_sample

MAX_BODY = 4 * 2**20  # a 1024x1024 canvas as base64 JSON is 1.4 MB; anything larger is refused unread
MAX_SIDE = 1024
REQUEST_TIMEOUT_S = 10.0  # seconds a connection may keep the server waiting for a request's bytes
LOOPBACK = ("127.0.0.1", "localhost", "::1")
CANVAS_SCALE = {"ocr-letters": 20}  # screen pixels per sample pixel (MNIST and EMNIST: 10)


class Reader:
    """The model and what it needs to read a drawing."""

    def __init__(self, model: torch.nn.Module, name: str, dataset: str):
        self.model, self.name, self.dataset = model, name, dataset
        (rows, cols), _ = SHAPES[dataset]
        scale = CANVAS_SCALE.get(dataset, 10)
        self.info = {"model": name, "dataset": dataset, "classes": CLASSES[dataset], "sample": [rows, cols],
                     "canvas": [rows * scale, cols * scale], "pen": round(1.8 * scale)}

    @torch.no_grad()
    def read(self, ink: torch.Tensor) -> dict:
        sample = to_sample(ink, self.dataset)
        probs = torch.softmax(self.model(normalize(sample, self.dataset)[None]).float(), dim=1)[0]
        shown = sample[0] * (255 if self.dataset == "ocr-letters" else 1)
        return {"prediction": int(probs.argmax()), "probabilities": [round(p, 6) for p in probs.tolist()],
                "sample": shown.round().clamp(0, 255).int().flatten().tolist()}


def load_reader(path: str) -> Reader:
    from partrain import model_file

    saved = model_file.load(path)
    if saved.dataset not in SHAPES:
        raise PartrainError(f"{path}: the model was trained on {saved.dataset!r}; serve reads drawings of "
                            f"{', '.join(SHAPES)} only")
    return Reader(saved.build(), saved.model, saved.dataset)


def parse_drawing(body: bytes) -> torch.Tensor:
    """``{"width", "height", "ink": base64 of width x height bytes}`` -> [height, width] uint8; ValueError if not."""
    try:
        req = json.loads(body)
        width, height, data = req["width"], req["height"], base64.b64decode(req["ink"], validate=True)
        if not all(type(side) is int for side in (width, height)):  # not 2.5 cut to 2, nor true taken as 1
            raise TypeError("width and height must be whole numbers")
    except (ValueError, KeyError, TypeError, OverflowError, RecursionError, binascii.Error) as err:  # Infinity, [[[...]]]
        raise ValueError(f"expected JSON {{width, height, ink: base64}}: {type(err).__name__}") from None
    if not (0 < width <= MAX_SIDE and 0 < height <= MAX_SIDE):
        raise ValueError(f"canvas {width}x{height} is outside 1..{MAX_SIDE} pixels a side")
    if len(data) != width * height:
        raise ValueError(f"ink has {len(data)} bytes, not width x height = {width * height}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).reshape(height, width)


def handler_for(reader: Reader) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "partrain-serve"
        timeout = REQUEST_TIMEOUT_S  # a client that connects and sends nothing (or less than it said) is dropped

        def _send(self, status: int, body: bytes, kind: str, **headers: str) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def _json(self, status: int, obj: dict) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json")

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            path = self.path.split("?")[0].split("#")[0]
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, PAGE.encode(), "text/html; charset=utf-8")
            elif path == "/info":
                self._json(HTTPStatus.OK, reader.info)
            else:
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {path}"})

        def do_POST(self) -> None:  # noqa: N802
            path = self.path.split("?")[0].split("#")[0]
            if path != "/predict":
                self._json(HTTPStatus.NOT_FOUND, {"error": f"no page {path}"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._json(HTTPStatus.LENGTH_REQUIRED, {"error": "a drawing needs a Content-Length"})
                return
            if not 0 < length <= MAX_BODY:
                self.close_connection = True  # the body is not read: do not reuse the connection
                self._json(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": f"a drawing is at most {MAX_BODY} bytes"})
                return
            try:
                ink = parse_drawing(self.rfile.read(length))
            except ValueError as err:
                self._json(HTTPStatus.BAD_REQUEST, {"error": str(err)})
                return
            self._json(HTTPStatus.OK, reader.read(ink))

        def _not_allowed(self) -> None:
            # any other method: JSON like every other answer, not http.server's HTML 501
            self.close_connection = True  # a body it may have sent is not read
            body = json.dumps({"error": f"{self.command} is not served: GET / or /info, POST /predict"}).encode()
            self._send(HTTPStatus.METHOD_NOT_ALLOWED, body, "application/json", Allow="GET, POST")

        do_PUT = do_DELETE = do_PATCH = do_OPTIONS = _not_allowed  # noqa: N815

        def log_message(self, format: str, *args) -> None:  # noqa: A002 - quiet: one line per drawing is noise
            pass

    return Handler


class IPv6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def make_server(reader: Reader, host: str = "127.0.0.1", port: int = 8000) -> HTTPServer:
    """One thread a request: a slow client holds its own request only (one client that sent
    nothing held the page for everyone, before)."""
    if host not in LOOPBACK:
        raise PartrainError(f"--host {host}: the drawing page serves this machine only; use 127.0.0.1")
    if not 0 <= port <= 65535:
        raise PartrainError(f"--port {port}: a port is 0 to 65535 (0: any free one)")
    server = IPv6Server if host == "::1" else ThreadingHTTPServer
    try:
        return server(("127.0.0.1" if host == "localhost" else host, port), handler_for(reader))
    except OSError as err:
        raise PartrainError(f"cannot listen on {host}:{port} ({err.strerror}): choose another --port, or 0 for any free one") from None
