"""ember.kv"""
