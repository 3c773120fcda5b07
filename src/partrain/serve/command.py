"""``partrain serve``: the parser and the handler (cli.py only calls ``add_parser``; torch loads on use)."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "serve", help="a page where you draw a character and see what a trained model reads",
        description="Serve, on 127.0.0.1 only, a page with a canvas: draw a digit (MNIST, EMNIST letters) or a letter "
        "(OCR letters) and see the class the model reads and every class's probability. The drawing is made into a "
        "sample as the dataset's were (MNIST: fitted into 20x20, centred by mass in 28x28). The model file is one "
        "written by `partrain train --save-model`, loaded with torch.load(weights_only=True).",
    )
    p.add_argument("--model-file", required=True, help="a file written by `partrain train --save-model FILE`")
    p.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default: 8000; 0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="127.0.0.1 (default), localhost or ::1: loopback only")
    p.set_defaults(func=run)


def run(args) -> int:
    from partrain.serve.server import load_reader, make_server

    reader = load_reader(args.model_file)
    server = make_server(reader, args.host, args.port)
    host, port = server.server_address[:2]
    print(f"{reader.name} on {reader.dataset}: draw at http://{host}:{port}/  (Ctrl-C stops)", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
    finally:
        server.server_close()
    return 0
