"""mmcache"""
