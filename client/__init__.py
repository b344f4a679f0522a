"""mqks.client"""
