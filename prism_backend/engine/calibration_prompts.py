"""The calibration prompts: fixed text shipped with the package, written for it (not taken from the
eval sets), in the shape of what Prism serves -- one document, several multiple-choice questions.

SmoothQuant (the exact precision) needs only activation maxima; GPTQ (the int8 precision) needs the
second moments of every projection's inputs, so the set is large enough to describe them: about
9,000 rows over 24 documents of many kinds, each asked four questions (one forest per document).
"""
from __future__ import annotations

SYSTEM = "You are a careful decision assistant."

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
    "Dear team, I moved to a new apartment last week and would like to update the delivery address on my "
    "account before the next shipment goes out on the 12th. The new address is Kastanienallee 41, 10435 "
    "Berlin. Could you also confirm whether the change applies to the order already placed? Best, Jonah",
    "Incident report #4471. At 14:32 the temperature sensor in cold room B reported 9.8 C for eleven "
    "minutes; the threshold is 8 C. The door log shows it was held open during a delivery. Stock was "
    "moved to cold room A at 14:50. No product was discarded; quality assurance has been informed.",
    "Section 12 (Termination). Either party may terminate this Agreement for convenience on ninety (90) "
    "days' written notice. Fees paid in advance for the remainder of the term are not refundable, except "
    "where the Provider terminates for convenience, in which case a pro-rata refund is due within 30 days.",
    "Wire transfer request: 48,500.00 EUR to a new beneficiary, Kestrel Trading FZE, Dubai, requested by "
    "email from the CFO's address at 18:55 on a Friday, marked confidential, asking that the usual "
    "call-back be skipped because the CFO is travelling.",
    "Hey! Just wanted to say the new dark mode is lovely, my eyes thank you. One small thing: the export "
    "button is hard to see in dark mode, grey on dark grey. Otherwise great work, keep it up :)",
    "Patient message: I have had a mild headache for two days and some tiredness. No fever, no vomiting. "
    "I am taking my usual blood pressure medication. Is it fine to take ibuprofen, or should I book an "
    "appointment first?",
    "Job application - Senior data engineer. Eight years of experience building batch and streaming "
    "pipelines (Spark, Flink, Kafka), two years leading a team of four. Looking for a hybrid role in "
    "Amsterdam; notice period two months; salary expectation in line with the posted range.",
    "Release notes 5.2.0: adds single sign-on with SAML for enterprise plans; fixes a crash when importing "
    "CSV files with more than 65,536 rows; deprecates the v1 reporting API, which will be removed in 6.0. "
    "Upgrading requires a database migration that takes about ten minutes for large installations.",
    "Hello, my parcel with tracking number 7734-KL-20 was marked as delivered yesterday but nothing "
    "arrived. My neighbours did not receive it either. It contained a birthday present, so I need it by "
    "Saturday. What can you do?",
    "Security alert: 214 failed login attempts for the admin account from 37 different IP addresses "
    "between 02:00 and 02:20 UTC, followed by one successful login from an address in a country where we "
    "have no staff. The session created two new API keys.",
    "Customer review, 2 of 5 stars: The blender is powerful but very loud, and after three weeks the lid "
    "started to leak. Customer service was friendly and sent a new lid, which also leaks a bit.",
    "Purchase order PO-2291: 1,200 units of part 44-B at 3.15 USD each, delivery to the Monterrey plant "
    "by 30 June, payment 60 days net. The quoted price on file is 2.85 USD; the buyer notes a supplier "
    "surcharge for raw materials.",
    "Dear landlord, the heating in flat 3 has not worked since Thursday. It is 14 degrees inside and my "
    "daughter is ill. I reported it by phone twice. Please send someone today, or tell me when they come.",
    "Policy update: from 1 September, employees may work from abroad for up to 30 days a year with "
    "manager approval, provided the country is on the approved list and no client data is processed "
    "outside the EU. Requests must be filed at least two weeks in advance.",
    "Chat log: user asks how to reset a password; agent sends the reset link; user replies that the "
    "link expired; agent sends a second link; user confirms it worked and asks to close the chat.",
    "Expense claim: taxi 38 EUR, dinner for 6 people 412 EUR (client meeting, no attendee list), hotel "
    "2 nights 290 EUR. Submitted 94 days after the trip; the policy deadline is 60 days.",
    "Support forum post: After upgrading to version 3.8 the sync client uses 100% CPU on my laptop and the "
    "fan never stops. Downgrading to 3.7 fixes it. Windows 11, 16 GB RAM. Anyone else seeing this?",
    "Insurance claim: rear-end collision at a red light on 3 March; the other driver admitted fault at "
    "the scene. Photos of the bumper attached; repair estimate 1,850 EUR; no injuries reported.",
]

QUESTIONS = [
    ("Which category fits best?", ("Billing", "Technical problem", "Legal", "Security", "Other")),
    ("How urgent is this?", ("Critical", "High", "Medium", "Low")),
    ("What is the tone of the text?", ("Angry", "Worried", "Neutral", "Positive")),
    ("What should happen next?", ("Escalate to a specialist", "Reply with information", "Approve",
                                  "Reject", "No action needed")),
]
