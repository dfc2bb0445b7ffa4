"""rayspeed.monitoring"""
