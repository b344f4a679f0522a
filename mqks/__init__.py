"""MQKS: Message Queue Kept Simple. The code lives in server/, client/ and spark/."""
