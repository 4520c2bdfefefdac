"""Generate the labelled decision eval sets (deterministic: fixed seed, templates with slots).

    .venv/bin/python evals/generate.py        # writes evals/data/<set>.jsonl

Each document is built from fragments whose meaning fixes the label (a double charge goes to
Billing, a site-wide outage is Critical...), then filled with neutral varied detail. Seven sets,
12,400 decisions in all:

    ticket_team, ticket_reply_time, ticket_severity   1,800 tickets, each asked all three
    contract_compliance                               1,800 clauses
    transaction_fraud                                 1,800 transactions
    content_moderation                                1,800 posts
    document_type                                     1,600 documents

A line: {"material": "...", "tasks": [{"set": "ticket_team", "task": "team", "label": "Billing"}, ...]}
where "task" is a registered task name or an inline JSON task.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

DATA = Path(__file__).resolve().parent / "data"
SEED = 20261129

NAMES = ["Anna", "Ben", "Carla", "Deniz", "Emeka", "Fatima", "Georg", "Hiro", "Ines", "Jonas", "Kofi", "Lena",
         "Marta", "Nils", "Olga", "Priya", "Quentin", "Rosa", "Sven", "Tomasz", "Umar", "Vera", "Wei", "Yara"]
COMPANIES = ["Acme Outdoor", "Northwind Design", "Blue Harbor Logistics", "Cedar Health", "Orbit Foods",
             "Pixel Forge", "Riverstone Legal", "Sunfield Energy", "Tandem Bikes", "Vertex Labs"]
PRODUCTS = ["the mobile app", "the web dashboard", "the reporting module", "the checkout", "the API",
            "the desktop client", "the scheduling tool", "the invoicing page"]

TEAM_ISSUES = {
    "Billing": ["I was charged twice for the same invoice this month", "our invoice lists the wrong VAT number",
                "the refund you promised has not arrived on my card", "we were billed for 40 seats but only use 25",
                "my card was charged after I cancelled the subscription"],
    "Technical support": ["{product} shows an error whenever I try to save", "{product} crashes on start",
                          "I cannot log in to {product} since the last update", "{product} is extremely slow today",
                          "the export in {product} produces an empty file"],
    "Sales": ["we would like a quote for 200 additional licences", "can you tell me the price of the enterprise plan",
              "we are interested in a three-year contract with volume discount",
              "I would like a demo of the premium features before we buy",
              "do you offer discounts for non-profit organisations"],
    "Account management": ["please transfer the account ownership to my colleague",
                           "we need to change the company name on our account",
                           "please add a second administrator to our workspace",
                           "we want to merge our two workspaces into one account",
                           "please update the primary contact email of our account"],
}
URGENCY = {
    "Within one hour": ["This blocks all of our customers right now, please respond immediately.",
                        "Our whole team is stopped until this is fixed, we need help right now.",
                        "We are losing orders every minute, this is an emergency."],
    "Within one business day": ["It would be good to have this sorted by tomorrow.",
                                "Please get back to me by the end of the next business day.",
                                "We need an answer before our meeting tomorrow afternoon."],
    "Within one week": ["There is no rush, whenever you have time is fine.",
                        "This is not urgent, an answer sometime next week is perfectly fine.",
                        "No hurry at all, we can wait a few days."],
}
SEVERITY = {
    "Low": ["It is only a cosmetic detail and nothing is broken.", "It is a minor inconvenience, everything else works."],
    "Medium": ["A few of our users are affected, but there is a workaround.",
               "It slows down some of our work, but we can continue."],
    "High": ["Most of our team cannot do their work and there is no workaround.",
             "An important part of our business process is blocked."],
    "Critical": ["Our entire service is down for all customers and we are losing revenue.",
                 "All of our systems are affected and nothing works at all."],
}
# Reply time and severity go together in real tickets; keep the pairs plausible.
PAIRS = [("Within one hour", "Critical"), ("Within one hour", "High"), ("Within one business day", "High"),
         ("Within one business day", "Medium"), ("Within one week", "Medium"), ("Within one week", "Low")]

POLICIES = [
    ("payment terms must not exceed 60 days",
     ["Invoices are payable within {n} days of receipt.", lambda n: n <= 60, [14, 30, 45, 60, 75, 90, 120]]),
    ("liability must be capped at the annual contract value",
     ["The supplier's total liability is {cap}.", lambda c: c.startswith("limited"),
      ["limited to the fees paid in the preceding twelve months", "limited to the annual contract value",
       "unlimited for all claims", "not limited in any way"]]),
    ("either party may terminate with at most 90 days notice",
     ["Either party may terminate this agreement with {n} days written notice.", lambda n: n <= 90,
      [30, 60, 90, 120, 180]]),
    ("customer data must be stored within the European Union",
     ["All customer data will be stored in data centres located in {loc}.", lambda l: l in ("Germany", "France", "Ireland"),
      ["Germany", "France", "Ireland", "the United States", "Singapore"]]),
]
FRAUD = {
    "Low risk": ["A card holder paid {amount} EUR at their usual grocery store in their home town.",
                 "A monthly subscription of {amount} EUR was renewed with the same card as every month.",
                 "A customer paid {amount} EUR at a pharmacy near their home, as they do regularly."],
    "Medium risk": ["A card holder paid {amount} EUR at an online shop they have never used before.",
                    "A purchase of {amount} EUR was made in another country the card holder visits occasionally.",
                    "A card holder bought electronics for {amount} EUR, more than they usually spend."],
    "High risk": ["Five purchases of {amount} EUR each were made within two minutes from three different countries.",
                  "The card was used for {amount} EUR of gift cards minutes after a failed PIN attempt abroad.",
                  "A new device in another country changed the password and then spent {amount} EUR on crypto."],
}
MODERATION = {
    "Allow": ["Had a great time at the {place} today, the weather was lovely.",
              "Does anyone know a good recipe for {food}? Thanks in advance!",
              "Congratulations to the team on winning the match at the {place} yesterday."],
    "Remove as spam": ["BUY CHEAP {food} NOW!!! Click the link in my profile, limited offer, 90% off!!!",
                       "Earn 5000 dollars a day from home, message me now, guaranteed, click here!!!",
                       "Free followers!!! Visit my page for free {food} coupons, click click click!!!"],
    "Remove as harassment": ["You are the most stupid person at the {place}, nobody wants you here, get lost.",
                             "Everyone at the {place} hates you, you worthless idiot, just disappear.",
                             "Shut up, you pathetic loser, nobody cares about your opinion on {food}."],
}
DOCUMENTS = {
    "Invoice": "INVOICE No. {n}\nBill to: {company}\nConsulting services, {m} hours at 120 EUR: {t} EUR\nVAT 19%\nPayment due within 30 days.",
    "Employment contract": "EMPLOYMENT AGREEMENT\nThis agreement is made between {company} (the Employer) and {name} (the Employee). The Employee will start on 1 March in the role of analyst, with a gross annual salary of {t} EUR and a probation period of {m} months.",
    "Resume": "{name}\nCURRICULUM VITAE\nExperience: {m} years as a software developer at {company}.\nEducation: MSc Computer Science.\nSkills: Python, SQL, project management.",
    "Meeting minutes": "MINUTES OF THE TEAM MEETING\nPresent: {name} and {m} colleagues from {company}.\nAgenda: 1. Budget review 2. Hiring plan\nDecisions: the budget of {t} EUR was approved. Next meeting in two weeks.",
    "Press release": "FOR IMMEDIATE RELEASE\n{company} announces record results\n{company} today reported revenue of {t} thousand EUR, up {m} percent from last year, said CEO {name}.",
}


def inline(question: str, options: list[str]) -> str:
    return json.dumps({"question": question, "options": options})


def tickets(rng: random.Random, n: int) -> list[dict]:
    out = []
    for i in range(n):
        team = rng.choice(list(TEAM_ISSUES))
        reply, severity = rng.choice(PAIRS)
        name, company, product = rng.choice(NAMES), rng.choice(COMPANIES), rng.choice(PRODUCTS)
        issue = rng.choice(TEAM_ISSUES[team]).format(product=product)
        text = (f"Subject: Request from {company} (#{10000 + i})\n\nHello, {issue}. "
                f"{rng.choice(SEVERITY[severity])} {rng.choice(URGENCY[reply])}\n\nBest regards, {name}, {company}")
        out.append({"material": text, "tasks": [
            {"set": "ticket_team", "task": "team@1", "label": team},
            {"set": "ticket_reply_time", "task": "reply_time@1", "label": reply},
            {"set": "ticket_severity", "task": "severity@2", "label": severity},
        ]})
    return out


def contracts(rng: random.Random, n: int) -> list[dict]:
    out = []
    for i in range(n):
        policy, (template, complies, values) = rng.choice(POLICIES)
        value = rng.choice(values)
        clause = template.format(n=value, cap=value, loc=value)
        text = f"Clause {rng.randint(2, 19)}.{rng.randint(1, 9)} of the agreement with {rng.choice(COMPANIES)}: {clause}"
        task = inline(f"Our policy: {policy}. Does this clause comply with the policy?", ["Compliant", "Not compliant"])
        out.append({"material": text, "tasks": [{"set": "contract_compliance", "task": task,
                                                 "label": "Compliant" if complies(value) else "Not compliant"}]})
    return out


def single_family(rng, n, table, set_name, question, fill) -> list[dict]:
    options = list(table)
    out = []
    for _ in range(n):
        label = rng.choice(options)
        template = rng.choice(table[label]) if isinstance(table[label], list) else table[label]
        out.append({"material": fill(template), "tasks": [{"set": set_name, "task": inline(question, options),
                                                           "label": label}]})
    return out


def generate() -> dict[str, list[dict]]:
    rng = random.Random(SEED)

    def fill(template):
        return template.format(amount=rng.choice([12, 35, 89, 240, 760, 1500]), place=rng.choice(["park", "stadium", "beach", "school"]),
                               food=rng.choice(["pancakes", "lentil soup", "pizza", "sushi"]), n=rng.randint(1000, 9999),
                               m=rng.randint(2, 12), t=rng.randint(2, 90) * 1000, company=rng.choice(COMPANIES),
                               name=rng.choice(NAMES))

    return {
        "tickets": tickets(rng, 1800),
        "contract_compliance": contracts(rng, 1800),
        "transaction_fraud": single_family(rng, 1800, FRAUD, "transaction_fraud",
                                           "How likely is this transaction to be fraudulent?", fill),
        "content_moderation": single_family(rng, 1800, MODERATION, "content_moderation",
                                            "Which moderation action fits this post?", fill),
        "document_type": single_family(rng, 1600, DOCUMENTS, "document_type", "What type of document is this?", fill),
    }


def main() -> None:
    DATA.mkdir(exist_ok=True)
    total = 0
    for name, rows in generate().items():
        with open(DATA / f"{name}.jsonl", "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        decisions = sum(len(r["tasks"]) for r in rows)
        total += decisions
        print(f"{name}: {len(rows)} documents, {decisions} decisions")
    print(f"total: {total} decisions")


if __name__ == "__main__":
    main()
