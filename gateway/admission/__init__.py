"""Admission: a bounded gateway queue with late binding, priority classes and fair shares."""
