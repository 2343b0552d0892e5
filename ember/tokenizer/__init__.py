"""ember.tokenizer"""
