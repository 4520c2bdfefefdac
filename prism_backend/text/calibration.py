"""Calibration prompts for smoothing (model/smoothing.py): chat-formatted decision prompts over a few
documents of the kinds Prism serves. Fixed text, shipped with the package, distinct from the eval
sets, so the smoothed weights are reproducible."""
from __future__ import annotations

from ..forest import EncodedRequest
from .prompt import render_prompt
from .tasks import Task

DOCUMENTS = [
    "Subject: Cannot download invoices\n\nHi, since Monday the invoice download button in the billing area "
    "returns an error 500. Our accountant needs the PDFs for the quarterly close on Friday. Thanks, Ola",
    "Subject: URGENT production outage\n\nAll API calls from our EU cluster time out since 03:10 UTC. "
    "Checkout is down for every customer and we are losing around 12,000 EUR per hour. Please call us now!",
    "Clause 7.2: The Supplier shall indemnify the Customer against all third-party claims arising from "
    "a breach of data protection law, without limitation of liability.",
    "Transaction 88-1192: 3 purchases of 499.00 USD at an electronics retailer in Lagos within 4 minutes, "
    "card issued in Norway, last domestic purchase 20 minutes earlier in Oslo.",
    "lol this update is trash, whoever designed the new menu should be fired. anyway does anyone know how "
    "to get the old layout back??",
    "MINUTES - Product council, 14 May. Attendees: R. Iyer, M. Okafor, S. Lindqvist. 1) Q3 roadmap approved. "
    "2) Pricing change postponed to July. Action: M. Okafor to draft the customer announcement.",
]
SYSTEM = "You are a careful decision assistant."
TASK = Task("calibration", None, "Which category fits best?", ("Billing", "Technical problem", "Legal", "Other"))


def calibration_requests(tokenizer) -> list[EncodedRequest]:
    """One single-branch request per document (the whole prompt, rendered as every decision prompt
    is, as the branch). Only the forward's activations matter: the candidates are placeholders."""
    requests = []
    for doc in DOCUMENTS:
        ids = tuple(tokenizer(render_prompt(tokenizer, SYSTEM, doc, TASK), add_special_tokens=False)["input_ids"])
        requests.append(EncodedRequest((), (), (ids,), ((0, 1),)))
    return requests
