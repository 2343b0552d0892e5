"""ember.engine"""
