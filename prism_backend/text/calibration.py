"""Calibration prompts for smoothing (smoothing.py): chat-formatted decision prompts over a few
documents of the kinds Prism serves. Fixed text, shipped with the package, distinct from the eval
sets, so the smoothed weights are reproducible."""
from __future__ import annotations

from ..forest import EncodedRequest

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
QUESTION = "Which category fits best?\nA) Billing\nB) Technical problem\nC) Legal\nD) Other"


def calibration_requests(tokenizer) -> list[EncodedRequest]:
    """One single-branch request per document (the whole prompt as the branch)."""
    requests = []
    for doc in DOCUMENTS:
        messages = [{"role": "system", "content": "You are a careful decision assistant."},
                    {"role": "user", "content": f"{doc}\n\n{QUESTION}"}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tuple(tokenizer(text, add_special_tokens=False)["input_ids"])
        requests.append(EncodedRequest((), (), (ids,), ((0, 1),)))
    return requests
