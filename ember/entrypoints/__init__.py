"""ember.entrypoints"""
