"""encode"""
