"""ember.attention"""
