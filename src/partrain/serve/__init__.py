"""``partrain serve``: a page where a person draws a character and sees what a trained model reads.

preprocess.py  a drawing made into a dataset sample, as the dataset itself was made
page.py        the HTML page: canvas, pen, predicted class and probabilities
server.py      stdlib http.server on 127.0.0.1, bounded requests
command.py     the parser and handler
"""
