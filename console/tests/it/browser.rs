//! Browser tests (PostgreSQL): headless Chromium through chromedriver.
